"""How big is the mask flex's block mask is built through (docs/measurements/2026-12-03-flex-attention.md)? The HF
Llama of tests/compiler/hf_models.py with attn_implementation="flex_attention", Dynamo's graph through AutoSP's
SP pass (rank 0 of P=2) and aot_autograd's partition, as AutoSP compiles it: the largest tensor of the forward and
backward graphs with two dims of the sequence length (or of it padded to 128), and the largest tensor any node of
the mask construction holds, with and without `flex_masks` (no ranks are launched: shapes only).
`python -m tests.compiler.flex_mask_bytes [seq_len]`."""
import sys

import torch

from autosp.compiler.sp.attention import flex_masks
from autosp.compiler.sp.walk import sequence_parallel_pass
from autosp.compiler.tracing import tracing_config
from tests.compiler.graphs import capture, partitioned
from tests.compiler.hf_models import build_hf_flex


def graph_bytes(seq_len: int) -> tuple[int, int]:
    """(bytes of the largest sequence-by-sequence tensor, bytes of the largest tensor) in the compiled graphs."""
    ids = torch.randint(0, 64, (1, seq_len))
    with tracing_config():
        gm, inputs = capture(build_hf_flex("llama-flex"), input_ids=ids, labels=ids)
    gm = sequence_parallel_pass(gm, sp_rank=0, sp_size=2, group_name="unused")
    graphs = partitioned(gm, inputs)
    lengths = {seq_len, -(-seq_len // 128) * 128}
    values = [n.meta["val"] for g in graphs for n in g.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    size = [v.numel() * v.element_size() for v in values]
    square = [s for s, v in zip(size, values) if sum(d in lengths for d in v.shape) >= 2]
    return max(square, default=0), max(size)


if __name__ == "__main__":
    seq_len = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    print(f"S={seq_len} with flex_masks: largest SxS tensor, largest tensor (bytes) {graph_bytes(seq_len)}")
    flex_masks.build_block_masks_by_rows = lambda gm: 0  # the dense path, as HF builds it
    print(f"S={seq_len} dense path: largest SxS tensor, largest tensor (bytes) {graph_bytes(seq_len)}")
