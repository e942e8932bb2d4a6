"""Attention in chunks of heads bounds one layer's full-length attention working set in backward: the liveness
replay of the partitioned backward graph (the planner's, `memory.planner.live_at_peak`, on fake tensors: byte counts)
peaks lower with chunks than without, at a length where attention binds, and backward runs the chunks one after
another. One rank's rewrite, no communication (exactness: tests/baselines/test_autosp_method.py)."""
from __future__ import annotations

import pytest
import torch
from torch._functorch.aot_autograd import aot_module_simplified

from autosp.compiler.memory.partitioner import make_partition_fn
from autosp.compiler.memory.planner import backward_inputs, live_at_peak
from autosp.compiler.sp.walk import sequence_parallel_pass
from autosp.compiler.tiling.loss import apply_tiling, parse_tiling
from tests.compiler.test_sp_pass import A2A, _llama_graph

#: MLP and loss in tiles of 256 tokens, so that what binds in backward is attention, not a token-wise block
TILING = "auto:256"


def _backward(name: str, seq_len: int, chunks: int, policy: str = "full"):
    """(the partitioned backward graph, the bytes its liveness replay peaks at) for rank 0 of 2."""
    gm, inputs = _llama_graph(name, seq_len=seq_len, batch_size=1)
    gm = sequence_parallel_pass(gm, sp_rank=0, sp_size=2, group_name="unused", attention_chunks=chunks)
    apply_tiling(gm, parse_tiling(TILING), loss_only=True)
    partition = make_partition_fn(policy, cacheable=False, offload="off")
    aot_module_simplified(gm, inputs, fw_compiler=lambda g, _: g.forward, partition_fn=partition)
    record = partition.records[-1]
    fw, bw = record.fw_module, record.bw_module
    return bw, live_at_peak(bw, backward_inputs(fw, bw, record.num_fwd_outputs))[0]


def _attention_backwards(bw) -> list[torch.fx.Node]:
    return [n for n in bw.graph.nodes if "attention" in str(n.target) and "backward" in str(n.target)]


@pytest.mark.parametrize("policy", ["full", pytest.param("sac", marks=pytest.mark.long)])
def test_chunks_of_heads_lower_the_backward_peak_where_attention_binds(policy):
    plain, plain_peak = _backward("tiny-mha", 4096, 1, policy)
    chunked, chunked_peak = _backward("tiny-mha", 4096, 2, policy)
    assert len(_attention_backwards(chunked)) == 2 * len(_attention_backwards(plain))
    # one full-length [1, 1 head, 4096, 16] fp32 tensor is 256 KiB: at least two fewer alive at the peak
    assert chunked_peak <= plain_peak - 2 * (256 << 10), (plain_peak, chunked_peak)


def test_backward_completes_each_chunk_before_the_next():
    """Between two attention backwards of a layer lie that chunk's gradient all-to-alls (q, k, v), and the next
    chunk's output-gradient all-to-all: the chunks' full-length gradients are never alive together."""
    bw, _ = _backward("tiny-mha", 256, 2)
    order = [("attention" if "attention" in str(n.target) else "a2a") for n in bw.graph.nodes
             if n.target is A2A or n in _attention_backwards(bw)]
    # per layer and chunk: the output gradient back to full length, attention backward, dq, dk, dv to the shard
    assert order == ["a2a", "attention", "a2a", "a2a", "a2a"] * 2 * 2, order
