"""FlexAttention under AutoSP (`autosp/compiler/flex.py`, issue 27): unmodified HF models with
attn_implementation="flex_attention" (block mask built in the graph from positions: causal, Mistral's sliding
window, packed documents) and a decoder whose score_mod and mask_mod read the head index (and whose sinks read
flex's logsumexp), against single-process training (loss, every gradient, parameters after AdamW steps)."""
from __future__ import annotations

import pytest

from tests.compiler.exactness import ExactnessRuns, exact_case


def _hf(family: str, seq_len: int, **case) -> dict:
    return exact_case(builder="tests.compiler.hf_models.build_hf_flex", family=family, seq_len=seq_len, **case)


def _decoder(seq_len: int, **case) -> dict:
    return exact_case(attention="flex", seq_len=seq_len, **case)


CASES = {
    "llama-2": (2, _hf("llama-flex", 32)),
    # alibi slopes and windows per head (rank 1 must read heads 2, 3 in its mods, not 0, 1), per-head sink logits
    # through flex's logsumexp (gpt-oss's sinks as HF runs them on GPUs: it comes back too), 31 tokens: padded
    "sinks-2": (2, _decoder(31, flex_sinks=True)),
    "chunks-2": (2, _decoder(32, compile_options={"attention_chunks": 2}, steps=1)),
    "one-head-2": (2, _decoder(32, heads=1, kv_heads=1, steps=1)),  # no ring form for flex: heads must split
}
#: the long profile's, in launches of their own (a module's cases of one world size share one launch)
LONG_CASES = {
    # a window of 8 tokens, 3 packed documents (HF's mask_mod reads them off position_ids), 31 tokens: padded
    "mistral-packed-2": (2, _hf("mistral-flex", 31, documents=3)),
    "head-mods-2": (2, _decoder(32)),  # the head-reading mods without sinks
    "llama-4": (4, _hf("llama-flex", 64)),  # 2 KV heads over 4 ranks: replicated
    "mistral-packed-4": (4, _hf("mistral-flex", 62, documents=3)),
    "head-mods-4": (4, _decoder(62)),
    "sinks-4": (4, _decoder(64, flex_sinks=True)),
}


@pytest.fixture(scope="module")
def runs() -> ExactnessRuns:
    return ExactnessRuns(CASES)


@pytest.fixture(scope="module")
def long_runs() -> ExactnessRuns:
    return ExactnessRuns(LONG_CASES)


@pytest.mark.parametrize("case", ["llama-2", "sinks-2"])
def test_flex_attention_is_exact(runs, case):
    runs.assert_exact(case)


def test_flex_attention_in_chunks_of_heads_is_refused_in_one_line(runs):
    runs.assert_refused("chunks-2", "blocks.0.attn", "flex_attention", "attention_chunks=1")


def test_flex_attention_with_heads_the_degree_does_not_divide_is_refused_in_one_line(runs):
    runs.assert_refused("one-head-2", "blocks.0.attn", "flex_attention with 1 query heads", "no ring form")


@pytest.mark.long
@pytest.mark.parametrize("case", LONG_CASES)
def test_flex_attention_is_exact_with_windows_packing_and_on_four_ranks(long_runs, case):
    long_runs.assert_exact(case)
