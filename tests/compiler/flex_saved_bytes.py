"""Is flex attention really sharded (docs/measurements/2026-12-03-flex-attention.md)? One training step of the same
HF Llama (tests/compiler/hf_models.py, 2 layers) through attn_implementation "sdpa" and "flex_attention" on P gloo
ranks: the activation bytes the compiled forward saves for backward, per rank (`PartitionRecord`), beside the
single-process graph's (P=1 lines: the same pipeline on one rank, nothing sharded).
`python -m tests.compiler.flex_saved_bytes [seq_len]`."""
import sys

import torch

import autosp
from autosp.harness.launch import launch
from tests.compiler.exactness import _batch
from tests.compiler.hf_models import build_hf, build_hf_flex


def saved_bytes(family: str, seq_len: int) -> int:
    model = (build_hf_flex if "flex" in family else build_hf)(family)
    compiled = autosp.compile(model, backend="aot_eager", sac="off", zero=0)
    compiled(**_batch(64, 1, seq_len, 0, 0.2)).loss.backward()
    return sum(r.saved_activation_bytes for r in compiled.partition_records)


if __name__ == "__main__":
    from tests.compiler.flex_saved_bytes import saved_bytes as rank_fn  # by module, not __main__: ranks import it

    seq_len = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    torch.manual_seed(0)
    for world_size in (1, 2, 4):
        for family in ("llama", "llama-flex"):
            outcome = launch(rank_fn, (family, seq_len), world_size=world_size, timeout_s=900)
            assert outcome.status == "ok", f"{outcome.error}\n{outcome.output_tail}"
            print(f"P={world_size} {family}: saved activation bytes per rank {outcome.results}")
