"""What both examples share: their common options, the model (an HF config with seeded weights, or local weights),
and packed training data from a local JSONL (one {"text": ...} per line) or plain-text file (a document a line).

Documents are tokenized (a local HF tokenizer, or bytes: token = byte value, EOS = 256, so no download is needed),
joined with EOS and cut into blocks of `seq_len` tokens, as HF's run_clm example packs them; labels are the inputs
(the model shifts them). Every rank reads the same file and takes the same blocks: AutoSP gives every SP rank the full
batch.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

BYTE_EOS = 256


def documents(path: str) -> list[str]:
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.endswith((".jsonl", ".json")):
        return [json.loads(line)["text"] for line in lines]
    return lines


def tokenize(texts: list[str], tokenizer_path: str | None) -> list[list[int]]:
    if tokenizer_path is None:
        return [list(text.encode("utf-8")) + [BYTE_EOS] for text in texts]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts)["input_ids"]]


def packed_blocks(path: str, seq_len: int, tokenizer_path: str | None = None) -> torch.Tensor:
    """(number of blocks, seq_len) token ids; the tail shorter than a block is dropped."""
    stream = [token for doc in tokenize(documents(path), tokenizer_path) for token in doc]
    if len(stream) < seq_len:
        raise SystemExit(f"{path} holds {len(stream)} tokens, fewer than one block of --seq-len {seq_len}")
    blocks = len(stream) // seq_len
    return torch.tensor(stream[: blocks * seq_len]).view(blocks, seq_len)


def batch(blocks: torch.Tensor, step: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
    """The batch of optimizer step `step`: a seeded permutation of the blocks, epoch after epoch (resumable)."""
    per_epoch = len(blocks) // batch_size
    if per_epoch == 0:
        raise SystemExit(f"{len(blocks)} blocks are fewer than --batch-size {batch_size}; use more data")
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed + epoch))
    ids = blocks[order[index * batch_size:(index + 1) * batch_size]]
    return {"input_ids": ids, "labels": ids.clone()}


def arguments(description: str) -> argparse.ArgumentParser:
    """The options both examples take; each adds its own."""
    p = argparse.ArgumentParser(description=description)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="an HF config.json: the model with seeded weights")
    source.add_argument("--weights", help="a local directory from_pretrained loads")
    p.add_argument("--data", required=True, help="a .jsonl ({'text': ...} per line) or text file (a document a line)")
    p.add_argument("--tokenizer", help="a local tokenizer directory (default: bytes)")
    p.add_argument("--out", required=True, help="checkpoints and the exported model (final/)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--save-every", type=int, default=0, help="a sharded checkpoint every N steps (0: none)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--tiling", default="auto")
    return p


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The same weights on every rank: seeded from `--seed`, or loaded from `--weights`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)
    if args.weights:
        return AutoModelForCausalLM.from_pretrained(args.weights, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config), attn_implementation="sdpa")
