"""FlexAttention under AutoSP (`autosp/compiler/sp/attention/flex.py`, issue 27): unmodified HF models with
attn_implementation="flex_attention" (block mask built in the graph from positions: causal, Mistral's sliding
window, packed documents, a padding attention_mask) and a decoder whose score_mod and mask_mod read the head
index (and whose sinks read flex's logsumexp), against single-process training (loss, every gradient, parameters
after AdamW steps); also in chunks of heads (`attention_chunks`) and with tiling."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from autosp.compiler.sp.attention.communicate import ALL_TO_ALL
from autosp.compiler.sp.attention.flex import FLEX_ATTENTION, check_lowering
from autosp.compiler.sp.walk import sequence_parallel_pass
from autosp.compiler.tiling.loss import apply_tiling, parse_tiling
from autosp.compiler.tracing import tracing_config
from autosp.errors import SequenceParallelError
from tests.compiler.exactness import ExactnessRuns, exact_case
from tests.compiler.graphs import capture, partitioned
from tests.compiler.models import Decoder, DecoderConfig, allow_flex_backward_on_cpu


def _hf(family: str, seq_len: int, **case) -> dict:
    return exact_case(builder="tests.compiler.hf_models.build_hf_flex", family=family, seq_len=seq_len, **case)


def _decoder(seq_len: int, **case) -> dict:
    return exact_case(attention="flex", seq_len=seq_len, **case)


CASES = {
    "llama-2": (2, _hf("llama-flex", 32)),
    # alibi slopes and windows per head (rank 1 must read heads 2, 3 in its mods, not 0, 1), per-head sink logits
    # through flex's logsumexp (gpt-oss's sinks as HF runs them on GPUs: it comes back too), 31 tokens: padded
    "sinks-2": (2, _decoder(31, flex_sinks=True)),
    # in 2 chunks of 1 head per rank: each chunk's mods read its own heads, the shared KV head sliced per chunk
    "llama-chunks-2": (2, _hf("llama-flex", 32, compile_options={"attention_chunks": 2})),
    "one-head-2": (2, _decoder(32, heads=1, kv_heads=1, steps=1)),  # no ring form for flex: heads must split
    "inductor-2": (2, _hf("llama-flex", 32, compile_options={"backend": "inductor"}, steps=1)),  # CPU: no backward
}
_TILED = {"tiling": "auto:8", "outputs": "loss"}
#: the long profile's, in launches of their own (a module's cases of one world size share one launch)
LONG_CASES = {
    # a window of 8 tokens, 3 packed documents (HF's mask_mod reads them off position_ids), 31 tokens: padded
    "mistral-packed-2": (2, _hf("mistral-flex", 31, documents=3)),
    "head-mods-2": (2, _decoder(32)),  # the head-reading mods without sinks
    "llama-4": (4, _hf("llama-flex", 64)),  # 2 KV heads over 4 ranks: replicated
    "mistral-packed-4": (4, _hf("mistral-flex", 62, documents=3)),
    "head-mods-4": (4, _decoder(62)),
    "sinks-4": (4, _decoder(64, flex_sinks=True)),
    # the default's chunks with sinks on a padded sequence (31 tokens), and a padding attention_mask (5 positions at
    # the right; HF's mask_mod reads it; its tracing is in the default profile: test_tracing)
    "sinks-chunks-2": (2, _decoder(31, flex_sinks=True, compile_options={"attention_chunks": 2})),
    "llama-padded-2": (2, _hf("llama-flex", 31, padding=5)),
    "mha-chunks-2": (2, _decoder(32, kv_heads=4, compile_options={"attention_chunks": 2}, steps=1)),  # KV split
    # with tiling (the loss, and the decoder's MLP, in tiles of 8 tokens): the block mask's vmaps kept through it
    "llama-tiled-2": (2, _hf("llama-flex", 32, compile_options=_TILED)),
    "head-mods-tiled-2": (2, _decoder(32, compile_options=_TILED)),
    "sinks-chunks-4": (4, _decoder(64, heads=8, flex_sinks=True, compile_options={"attention_chunks": 2})),
}


@pytest.fixture(scope="module")
def runs() -> ExactnessRuns:
    return ExactnessRuns(CASES)


@pytest.fixture(scope="module")
def long_runs() -> ExactnessRuns:
    return ExactnessRuns(LONG_CASES)


@pytest.mark.parametrize("case", ["llama-2", "sinks-2", "llama-chunks-2"])
def test_flex_attention_is_exact(runs, case):
    runs.assert_exact(case)


def _chunked(sp_rank: int, chunks: int = 2, **config) -> tuple[fx.GraphModule, list, Decoder]:
    """The flex decoder's graph (with sinks) after the pass on rank `sp_rank` of 2 in `chunks` chunks of heads."""
    allow_flex_backward_on_cpu()
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (1, 32))
    model = Decoder(DecoderConfig(attention="flex", flex_sinks=True, **config))
    with tracing_config():
        gm, inputs = capture(model, input_ids=ids, labels=ids)
    gm = sequence_parallel_pass(gm, sp_rank=sp_rank, sp_size=2, group_name="unused", attention_chunks=chunks)
    return gm, inputs, model


def test_flex_attention_in_chunks_runs_one_hop_per_chunk_on_its_own_heads():
    """Rank 1 of 2, 2 chunks: per layer two HOPs of one query head, whose mask_mods read the model's heads 2 and 3
    (a window of 8 * (h + 1) keys: 28 positions back is inside it for head 3 only)."""
    gm, _, model = _chunked(1)
    hops = [n for n in gm.graph.nodes if n.target is FLEX_ATTENTION]
    assert len(hops) == 2 * model.cfg.layers
    assert all(hop.args[0].meta["example_value"].shape[1] == 1 for hop in hops)  # the query's heads
    assert all(hop.args[4][2].meta["example_value"].shape[1] == 1 for hop in hops)  # the block mask's
    q, kv = torch.tensor(28), torch.tensor(0)
    inside = [bool(gm.get_submodule(hop.args[4][-1].target)(0, torch.tensor(0), q, kv)) for hop in hops]
    assert inside == [False, True] * model.cfg.layers


def test_flex_attention_in_chunks_runs_each_chunk_before_the_next_in_forward_and_backward():
    """One chunk's full-length tensors at a time: per chunk (KV heads split into the chunks), forward exchanges q, k,
    v, attends and sends output and logsumexp back; backward the reverse, each chunk done before the next."""
    gm, inputs, model = _chunked(0, kv_heads=4)
    forward, backward = ([("attention" if n.target is not ALL_TO_ALL else "a2a") for n in g.graph.nodes
                          if n.target is ALL_TO_ALL or "flex_attention" in str(n.target)]
                         for g in partitioned(gm, inputs))
    assert forward == (["a2a"] * 3 + ["attention"] + ["a2a"] * 2) * 2 * model.cfg.layers, forward
    assert backward == (["a2a"] * 2 + ["attention"] + ["a2a"] * 3) * 2 * model.cfg.layers, backward


def test_flex_attention_graph_keeps_its_vmap_levels_through_tiling():
    """The block mask's construction enters vmap levels (results unused) that its `_add_batch_dim`s need: tiling's
    dead-code elimination must keep them, or aot_autograd fails ("tensor may have escaped ... being vmapped")."""
    gm, inputs, _ = _chunked(0, chunks=1)
    apply_tiling(gm, parse_tiling("auto:8"), loss_only=True)
    forward, backward = partitioned(gm, inputs)
    assert any(n.target is FLEX_ATTENTION for n in gm.graph.nodes) and forward and backward


def test_flex_attention_in_chunks_not_dividing_a_ranks_heads_is_refused_in_one_line():
    with pytest.raises(SequenceParallelError, match=r"blocks\.0\.attn .*attention_chunks=3 must divide the 2 query heads"):
        _chunked(0, chunks=3)


def test_flex_attention_with_heads_the_degree_does_not_divide_is_refused_in_one_line(runs):
    runs.assert_refused("one-head-2", "blocks.0.attn", "flex_attention with 1 query heads", "no ring form")


def test_flex_attention_training_on_cpu_under_inductor_is_refused_in_one_line(runs):
    """torch's CPU flex kernel in Inductor is inference-only: it failed deep inside Inductor (IndexError)."""
    runs.assert_refused("inductor-2", "layers.0.self_attn", "on CPU for inference only", "backend='aot_eager'")


def test_flex_attention_inference_on_cpu_under_inductor_is_not_refused():
    """Only training is refused: without grad mode (aot_autograd's inference graph) Inductor's CPU kernel runs."""
    gm, _, _ = _chunked(0, chunks=1)
    with torch.no_grad():
        check_lowering(gm, "inductor")
    with pytest.raises(SequenceParallelError, match=r"blocks\.0\.attn .*on CPU for inference only"):
        check_lowering(gm, "inductor")


@pytest.mark.long
@pytest.mark.parametrize("case", LONG_CASES)
def test_flex_attention_is_exact_with_windows_packing_padding_chunks_tiling_and_on_four_ranks(long_runs, case):
    worst = long_runs.assert_exact(case)
    assert "tiled" not in case or worst["tiling"].startswith("loss tiled over 16 tokens"), worst
