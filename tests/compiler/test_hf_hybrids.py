"""Unmodified HF hybrid models (issue 45) against single-process training at P=2 and P=4: short causal convolutions
with a halo from the previous rank (LFM2, LFM2-MoE), and the gated delta rule with its state passed along the ranks
(Qwen3-Next with its MoE, Qwen3.5), beside softmax attention; ZeRO 0 and 3."""
from __future__ import annotations

import pytest

from tests.compiler.exactness import ExactnessRuns, exact_case

# The gated delta-net's A_log and dt_bias have one gradient entry per head, each a sum over every token of terms of
# both signs; AdamW's first step moves a parameter by lr * g / (|g| + eps), so an entry near eps is resolved by its fp32
# rounding, which the sharded sums change (A_log/dt_bias gradients agreed within 2e-5 at P=2, the parameters after
# the step 2.5e-3 apart with eps=1e-8); eps=1e-6 as for olmoe in test_hf_moe
_GDN_EPS = 1e-6


def _hf(family: str, seq_len: int, adamw_eps: float = 1e-8, **compile_options) -> dict:
    return exact_case(builder="tests.compiler.hf_models.build_hf", family=family, seq_len=seq_len,
                      adamw_eps=adamw_eps, compile_options=compile_options)


#: name -> (world size, case); one launch per world size runs them all
CASES = {
    "lfm2-2": (2, _hf("lfm2", 32)),
    "lfm2-zero3-2": (2, _hf("lfm2", 31, zero=3)),  # rank 1's shard padded
    "lfm2-moe-2": (2, _hf("lfm2-moe", 32)),
    "qwen3-next-2": (2, _hf("qwen3-next", 32, _GDN_EPS)),
    "qwen3-next-zero3-2": (2, _hf("qwen3-next", 31, _GDN_EPS, zero=3)),
    "qwen3.5-2": (2, _hf("qwen3.5", 32, _GDN_EPS)),
    "lfm2-4": (4, _hf("lfm2", 32)),
    "lfm2-zero3-4": (4, _hf("lfm2", 30, zero=3)),
    "lfm2-moe-4": (4, _hf("lfm2-moe", 32)),
    "qwen3-next-4": (4, _hf("qwen3-next", 32, _GDN_EPS)),
    "qwen3.5-zero3-4": (4, _hf("qwen3.5", 30, _GDN_EPS, zero=3)),
}


@pytest.fixture(scope="module")
def runs() -> ExactnessRuns:
    return ExactnessRuns(CASES)


@pytest.mark.parametrize("case", ["lfm2-2", "lfm2-zero3-2", "lfm2-moe-2"])
def test_short_causal_convolutions_are_exact_on_two_ranks(runs, case):
    runs.assert_exact(case)


@pytest.mark.parametrize("case", ["qwen3-next-2", "qwen3-next-zero3-2", "qwen3.5-2"])
def test_gated_delta_rule_is_exact_on_two_ranks(runs, case):
    runs.assert_exact(case)


@pytest.mark.long
@pytest.mark.parametrize("case", ["lfm2-4", "lfm2-zero3-4", "lfm2-moe-4", "qwen3-next-4", "qwen3.5-zero3-4"])
def test_hybrids_are_exact_on_four_ranks(runs, case):
    runs.assert_exact(case)
