"""Train an HF causal LM with AutoSP on packed data from a local file: bf16, ZeRO 3, tiling, periodic sharded
checkpoints and resume, the full weights exported at the end (`from_pretrained` loads them).

    torchrun --nproc-per-node 2 examples/train_autosp.py --config examples/tiny_config.json \
        --data examples/data/tiny.jsonl --seq-len 256 --steps 100 --save-every 50 --out runs/tiny

The model comes from an HF config with seeded weights (`--config`), or from local weights (`--weights DIR`).
`--resume` continues from the newest checkpoint in `--out` (at any world size) as the uninterrupted run: the checkpoint
holds the random number generators' state (dropout), and the data order is a function of the step. Every rank passes
the full batch; the printed loss is the single-device loss.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import autosp
from autosp.training import checkpoint
from autosp.training.gradients import clip_grad_norm_

from common import arguments, batch, build_model, packed_blocks


def parse() -> argparse.Namespace:
    p = arguments(__doc__.split("\n\n")[0])
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    return p.parse_args()


def newest_checkpoint(out: Path) -> Path | None:
    steps = sorted((int(p.name.removeprefix("step-")), p) for p in out.glob("step-*") if (p / ".metadata").is_file())
    return steps[-1][1] if steps else None


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The generators dropout draws from; every rank's are equal (same seed, same draws), so one copy is kept."""
    state = {"rng.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["rng.cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(extra: dict, device: torch.device) -> None:
    torch.set_rng_state(extra["rng.cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(extra["rng.cuda"], device)


def main() -> None:
    args = parse()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = autosp.compile(build_model(args).to(device), zero=3, compute_dtype=torch.bfloat16, tiling=args.tiling,
                           outputs="loss", backend=args.backend)
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    blocks = packed_blocks(args.data, args.seq_len, args.tokenizer)
    out, start = Path(args.out), 0
    if args.resume and (found := newest_checkpoint(out)):
        extra = checkpoint.load(found, model, optimizer)
        start = extra["step"]
        set_rng_state(extra, device)
    for step in range(start, args.steps):
        inputs = {k: v.to(device) for k, v in batch(blocks, step, args.batch_size, args.seed).items()}
        loss = model(**inputs).loss
        loss.backward()
        norm = clip_grad_norm_(model, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(json.dumps({"step": step, "loss": loss.item(), "grad_norm": norm.item()}), flush=True)
        if args.save_every and (step + 1) % args.save_every == 0:
            checkpoint.save(out / f"step-{step + 1}", model, optimizer, extra={"step": step + 1, **rng_state(device)})
    checkpoint.export(out / "final", model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
