"""Unmodified HF models whose attention or rope is not the plain causal SDPA (issue 27), against single-process
training: gpt-oss's attention sinks in eager attention with alternating sliding windows, Llama 4's chunked local
attention with a NoPE layer and its dense-routed experts, Phi-3's LongRoPE past its original context
(HF flex attention: tests/compiler/test_flex.py)."""
from __future__ import annotations

import pytest

from tests.compiler.exactness import ExactnessRuns, exact_case


def _hf(family: str, seq_len: int, steps: int = 2, **compile_options) -> dict:
    return exact_case(builder="tests.compiler.hf_models.build_hf", family=family, seq_len=seq_len, steps=steps,
                      compile_options=compile_options)


# gpt-oss, one step: its first batch's gradients agree within 1e-6, but some entries are ~1e-8 (layer-1 experts,
# lm_head rows), under AdamW's eps=1e-8, and the first step resolves them by their fp32 rounding (parameters
# 3.1e-5 apart, see tests/compiler/exactness.py); the second step's gradients, taken at parameters already that
# far apart, came out 1.0e-4 apart (with eps=1e-6: parameters 2.7e-4 apart after two steps). Single-process training
# whose parameters after step 1 are perturbed by as much (+-3.1e-5) moves step 2's gradients by 2.0e-4 to 2.8e-4
# (`python -m tests.compiler.gpt_oss_sensitivity`): the second step measures that sensitivity, not the pass, so it
# is not checked here
CASES = {
    "gpt-oss-2": (2, _hf("gpt-oss", 31, steps=1)),  # 31 tokens: the sink column sits after padded keys
    "gpt-oss-flex-2": (2, _hf("gpt-oss-flex", 32, steps=1)),  # refused: HF raises for sinks through flex on CPU
    "llama4-2": (2, _hf("llama4", 32)),
    "phi3-longrope-2": (2, _hf("phi3-longrope", 32)),  # rank 0's positions alone (0..15) would pick short factors
    "gpt-oss-4": (4, _hf("gpt-oss", 64, steps=1)),
    "llama4-4": (4, _hf("llama4", 62)),
    "phi3-longrope-4": (4, _hf("phi3-longrope", 64)),
}


@pytest.fixture(scope="module")
def runs() -> ExactnessRuns:
    return ExactnessRuns(CASES)


@pytest.mark.parametrize("case", ["gpt-oss-2", "llama4-2", "phi3-longrope-2"])
def test_unmodified_hf_attention_variants_are_exact(runs, case):
    runs.assert_exact(case)


def test_gpt_oss_through_hf_flex_attention_is_refused_in_one_line(runs):
    """HF's flex path raises for attention sinks on CPU, single-device too: AutoSP reports that error, one line,
    naming the layer, rather than a graph break."""
    runs.assert_refused("gpt-oss-flex-2", "the model's forward in `model.layers.0.self_attn` (GptOssAttention) raised "
                        "exception ValueError('Attention sinks cannot be run on CPU with flex attention")


@pytest.mark.long
@pytest.mark.parametrize("case", ["gpt-oss-4", "llama4-4", "phi3-longrope-4"])
def test_unmodified_hf_attention_variants_are_exact_on_four_ranks(runs, case):
    runs.assert_exact(case)
