"""Graph-level tests of the SP pass on the project Llama and HF Llama graphs (one rank's rewrite, no communication)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition

import autosp.comm  # noqa: F401
from autosp.compiler.sp.walk import sequence_parallel_pass
from autosp.harness.config import DataConfig
from autosp.errors import SequenceParallelError
from autosp.models import build_model, get_preset
from autosp.models.data import make_batch
from tests.compiler.graphs import capture, count

A2A = torch.ops.autosp_sp.all_to_all.default
ALL_REDUCE = torch.ops.autosp_sp.all_reduce_sum.default


def _llama_graph(name="tiny", seq_len=64, batch_size=2, **data):
    model = build_model(name, seed=0)
    batch = make_batch(DataConfig(**data), batch_size=batch_size, seq_len=seq_len,
                       vocab_size=get_preset(name).vocab_size, seed=0)
    return capture(model, **batch.model_kwargs())


def _sp(gm, sp_size=2, sp_rank=0):
    return sequence_parallel_pass(gm, sp_rank=sp_rank, sp_size=sp_size, group_name="unused")


@pytest.mark.parametrize("name", ["tiny", "hf:tiny"])
def test_four_all_to_alls_per_attention_layer_forward_and_backward(name):
    gm, inputs = _llama_graph(name, ignore_fraction=0.2)
    layers = get_preset(name).num_layers
    gm = _sp(gm)
    assert count(gm, A2A) == 4 * layers
    graphs = []

    def partition(joint, joint_inputs, **kwargs):
        graphs.extend(default_partition(joint, joint_inputs, **kwargs))
        return graphs

    aot_module_simplified(gm, inputs, fw_compiler=lambda g, _: g.forward, partition_fn=partition)
    a2a_packet = torch.ops.autosp_sp.all_to_all
    for graph in graphs:  # forward, then backward: exactly the gradient all-to-alls of the forward ones
        assert sum(1 for n in graph.graph.nodes if getattr(n.target, "overloadpacket", None) is a2a_packet) == 4 * layers


def test_graph_traced_without_grad_is_rewritten_the_same_way():
    model = build_model("tiny", seed=0)
    batch = make_batch(DataConfig(), batch_size=2, seq_len=64, vocab_size=get_preset("tiny").vocab_size, seed=0)
    with torch.no_grad():  # evaluation: nothing requires grad, the frontier must still be found
        gm, _ = capture(model, **batch.model_kwargs())
    assert count(_sp(gm), A2A) == 4 * get_preset("tiny").num_layers


def test_sequence_inputs_are_sharded_at_the_trainable_frontier_with_global_offsets():
    gm, _ = _llama_graph("tiny", seq_len=64, packed_documents=2)
    gm = _sp(gm, sp_size=4, sp_rank=3)
    narrows = [n for n in gm.graph.nodes if n.target == "narrow"]
    # token ids at the embedding, rotary cos/sin at q/k, labels at the loss: all start at rank 3's offset 48
    assert narrows and all(n.args[2] == 48 and n.args[3] == 16 for n in narrows)
    (embedding,) = [n for n in gm.graph.nodes if n.target is F.embedding]
    assert embedding.args[0].target == "narrow"
    views = [n for n in gm.graph.nodes if n.target == "view" and 16 in n.args[1:]]
    assert views, "hard-coded sequence sizes in views must be resized to the local 16"
    assert count(gm, ALL_REDUCE) == 1  # the loss, once


def test_kv_heads_fewer_than_sp_degree_are_replicated():
    gm, _ = _llama_graph("tiny", seq_len=64)  # 4 query heads, 2 KV heads
    gm = _sp(gm, sp_size=4)
    repeats = [n for n in gm.graph.nodes if n.target is torch.repeat_interleave]
    assert len(repeats) == 2 * get_preset("tiny").num_layers and all(n.args[1] == 2 for n in repeats)


RING = torch.ops.autosp_sp.ring_attention.default


@pytest.mark.parametrize("sp_size, ulysses_size, a2as, rings", [
    (3, None, 0, 2),  # 4 heads on 3 ranks: pure ring (u=1), no all-to-all
    (4, 2, 4 * 2, 2),  # forced Ulysses groups of 2, ring over 2 groups
    (4, None, 4 * 2, 0),  # heads divide the degree: pure Ulysses
])
def test_heads_not_dividing_the_degree_get_a_hybrid_ulysses_ring(sp_size, ulysses_size, a2as, rings):
    gm, _ = _llama_graph("tiny", seq_len=48)
    groups = []
    gm = sequence_parallel_pass(gm, sp_rank=1, sp_size=sp_size, group_name="sp", ulysses_size=ulysses_size,
                                hybrid_groups=lambda u: groups.append(u) or ("ulysses", "ring"))
    assert (count(gm, A2A), count(gm, RING)) == (a2as, rings)
    assert all(n.args[-1] == ("ring" if rings else "sp") for n in gm.graph.nodes if n.target is RING)
    assert groups == ([ulysses_size or 1] if rings else [])


def test_bad_ulysses_size_names_the_valid_ones():
    gm, _ = _llama_graph("tiny", seq_len=48)
    with pytest.raises(SequenceParallelError, match=r"ulysses_size=3 must divide.*valid here: \[1, 2, 4\]"):
        sequence_parallel_pass(gm, sp_rank=0, sp_size=4, group_name="sp", ulysses_size=3)


def test_sequence_not_divisible_is_padded_on_the_last_shards():
    gm, _ = _llama_graph("tiny", seq_len=50, ignore_fraction=0.2)  # shards of 13: rank 3 holds 39..51, 2 padded
    gm = _sp(gm, sp_size=4, sp_rank=3)
    pads = [n for n in gm.graph.nodes if n.target is F.pad and n.args[1][-1] == 2]
    assert {n.kwargs["value"] for n in pads} == {0, -100}  # token ids / positions with 0, loss targets ignored
    narrows = [n for n in gm.graph.nodes if n.target == "narrow" and n.args[2] == 39]
    assert narrows and all(n.args[3] == 11 for n in narrows)  # the real positions, then the pad: never a full copy
    assert all(50 not in p.args[0].meta["example_value"].shape for p in pads)


class _NoAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)

    def forward(self, input_ids):
        return self.emb(input_ids).sum()


class _SequenceByItself(torch.nn.Module):
    """One SDPA layer followed by token-token products that are no attention: they cannot be rewritten."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)

    def forward(self, input_ids):
        h = self.emb(input_ids).view(2, 16, 2, 8).transpose(1, 2)
        h = F.scaled_dot_product_attention(h, h, h, is_causal=True)
        return (h @ h.transpose(-1, -2)).exp().sum()


def test_no_attention_is_a_clear_error():
    gm, _ = capture(_NoAttention(), input_ids=torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(SequenceParallelError, match="no attention found"):
        _sp(gm)


def test_unrewritable_attention_pattern_is_named():
    gm, _ = capture(_SequenceByItself(), input_ids=torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(SequenceParallelError, match="attention pattern AutoSP cannot rewrite"):
        _sp(gm)


def test_hand_written_attention_with_soft_capping_gets_the_four_all_to_alls():
    from tests.compiler.models import build_decoder

    ids = torch.zeros(1, 30, dtype=torch.long)  # 30 on 4 ranks: shards of 8, the last two positions padded
    gm, _ = capture(build_decoder(attention="eager", softcap=20.0), input_ids=ids, labels=ids)
    gm = _sp(gm, sp_size=4, sp_rank=1)
    assert count(gm, A2A) == 4 * 2
    assert count(gm, torch.tanh) == 2  # the soft-cap runs inside the region, on this rank's heads over all 32
    (softmax, *_) = [n for n in gm.graph.nodes if n.target is F.softmax]
    assert tuple(softmax.meta["example_value"].shape) == (1, 1, 32, 32)


def test_moe_routing_is_followed_locally_and_global_indices_are_refused():
    from tests.compiler.models import build_decoder

    ids = torch.zeros(2, 32, dtype=torch.long)
    gm, _ = capture(build_decoder(experts=4, top_k=2), input_ids=ids, labels=ids)
    gm = _sp(gm, sp_size=4, sp_rank=2)
    (index_add, *_) = [n for n in gm.graph.nodes if n.target == "index_add_"]
    assert tuple(index_add.meta["example_value"].shape) == (2 * 8, 32)  # this rank's 2 x 8 tokens, added back


class _GlobalIndex(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)

    def forward(self, input_ids):
        h = self.emb(input_ids).view(1, 16, 2, 8).transpose(1, 2)
        h = F.scaled_dot_product_attention(h, h, h, is_causal=True).transpose(1, 2).reshape(16, 16)
        return h[torch.arange(16).flip(0)].cumsum(0).sum()


def test_indexing_the_shard_with_global_positions_is_refused():
    gm, _ = capture(_GlobalIndex(), input_ids=torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(SequenceParallelError, match="not computed from this rank's tokens"):
        _sp(gm)


def _a2a_sizes(gm) -> list[int]:
    return [n.meta["example_value"].numel() for n in gm.graph.nodes if n.target is A2A]


@pytest.mark.parametrize("name, sp_size, chunks, kv_shared", [
    ("tiny-mha", 2, 2, False),  # MHA: every all-to-all of a chunk is 1/c the size
    ("small", 2, 4, True),  # GQA, 2 KV heads per rank for chunks of 1 query head: KV exchanged once, sliced
    ("tiny", 2, 2, True),  # GQA, 1 KV head per rank (the llama-3.1-8b case at 8 ranks)
])
def test_attention_chunks_make_each_query_and_output_all_to_all_one_cth(name, sp_size, chunks, kv_shared):
    layers = get_preset(name).num_layers
    plain = _a2a_sizes(_sp(_llama_graph(name)[0], sp_size=sp_size))
    gm = sequence_parallel_pass(_llama_graph(name)[0], sp_rank=1, sp_size=sp_size, group_name="unused",
                                attention_chunks=chunks)
    sizes = _a2a_sizes(gm)
    q, k, out = plain[0], plain[1], plain[3]  # per layer: q, k, v, then the output's all-to-all back
    per_layer = (2 + 2 * chunks) if kv_shared else 4 * chunks
    assert len(sizes) == per_layer * layers
    layer = sizes[:per_layer]
    if kv_shared:
        assert layer[:2] == [k, k] and layer[2:] == [q // chunks, out // chunks] * chunks
    else:
        assert layer == [q // chunks, k // chunks, k // chunks, out // chunks] * chunks
    assert sum(sizes) <= sum(plain)  # no head is exchanged twice


def test_attention_chunks_with_the_hybrid_ring_give_one_ring_per_chunk():
    gm, _ = _llama_graph("tiny", seq_len=48)
    gm = sequence_parallel_pass(gm, sp_rank=1, sp_size=4, group_name="sp", ulysses_size=2, attention_chunks=2,
                                hybrid_groups=lambda u: ("ulysses", "ring"))
    assert count(gm, RING) == 2 * get_preset("tiny").num_layers


def test_attention_chunks_not_dividing_the_heads_of_a_rank_name_the_divisors():
    gm, _ = _llama_graph("tiny")
    with pytest.raises(SequenceParallelError, match=r"attention_chunks=3 must divide the 2 query heads each rank"):
        sequence_parallel_pass(gm, sp_rank=0, sp_size=2, group_name="unused", attention_chunks=3)
