"""Unmodified HF hybrid models (issue 45) against single-process training: short causal convolutions with a halo
from the previous rank, beside softmax attention, at P=2 and P=4, ZeRO 0 and 3."""
from __future__ import annotations

import pytest

from tests.compiler.exactness import ExactnessRuns, exact_case


def _hf(family: str, seq_len: int, **compile_options) -> dict:
    return exact_case(builder="tests.compiler.hf_models.build_hf", family=family, seq_len=seq_len,
                      compile_options=compile_options)


#: name -> (world size, case); one launch per world size runs them all
CASES = {
    "lfm2-2": (2, _hf("lfm2", 32)),
    "lfm2-zero3-2": (2, _hf("lfm2", 31, zero=3)),  # rank 1's shard padded
    "lfm2-moe-2": (2, _hf("lfm2-moe", 32)),
    "lfm2-4": (4, _hf("lfm2", 32)),
    "lfm2-zero3-4": (4, _hf("lfm2", 30, zero=3)),
    "lfm2-moe-4": (4, _hf("lfm2-moe", 32)),
}


@pytest.fixture(scope="module")
def runs() -> ExactnessRuns:
    return ExactnessRuns(CASES)


@pytest.mark.parametrize("case", ["lfm2-2", "lfm2-zero3-2", "lfm2-moe-2"])
def test_short_causal_convolutions_are_exact_on_two_ranks(runs, case):
    runs.assert_exact(case)


@pytest.mark.parametrize("case", ["lfm2-4", "lfm2-zero3-4", "lfm2-moe-4"])
def test_short_causal_convolutions_are_exact_on_four_ranks(runs, case):
    runs.assert_exact(case)
