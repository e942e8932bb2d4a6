"""The same training as train_autosp.py through the HF Trainer: `AutoSPTrainer` is the one changed line.

    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --config examples/tiny_config.json \
        --data examples/data/tiny.jsonl --seq-len 256 --steps 100 --save-every 50 --out runs/tiny-trainer

bf16 (AutoSP's mixed precision), ZeRO 3, tiling; the Trainer's checkpoints every `--save-every` steps hold the
model and optimizer sharded, and `--resume` continues from the newest (at any world size). The weights of the end
are in `--out/final` (`from_pretrained` loads them).
"""
from __future__ import annotations

import argparse

import torch
from transformers import TrainingArguments

from autosp.training.hf_trainer import AutoSPTrainer

from common import arguments, build_model, packed_blocks


def parse() -> argparse.Namespace:
    p = arguments(__doc__.split("\n\n")[0])
    p.add_argument("--grad-accumulation", type=int, default=1)
    return p.parse_args()


def main() -> None:
    args = parse()
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accumulation, learning_rate=args.lr, weight_decay=0.1,
        lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 20), max_grad_norm=1.0, bf16=True,
        logging_steps=1, save_strategy="steps" if args.save_every else "no", save_steps=args.save_every or 1,
        report_to=[], seed=args.seed, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available())  # TrainingArguments starts torch.distributed under torchrun
    model = build_model(args)
    blocks = packed_blocks(args.data, args.seq_len, args.tokenizer)
    dataset = [{"input_ids": ids, "labels": ids.clone()} for ids in blocks]
    trainer = AutoSPTrainer(model=model, args=training, train_dataset=dataset,
                            autosp_options={"zero": 3, "tiling": args.tiling, "outputs": "loss",
                                            "backend": args.backend})
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(f"{args.out}/final")


if __name__ == "__main__":
    main()
