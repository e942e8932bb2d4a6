"""The Mamba families the hybrids' tests left out (issue 45), against single-process training at P=2 and P=4 (loss,
every gradient, every parameter after AdamW): Mamba and FalconMamba (Mamba1's selective scan with no attention at
all), Zamba2 (Mamba2 layers and a shared attention block), and right padding through `attention_mask` for both scans
(SSD: Mamba2; Mamba1: Mamba): HF zeroes the padded positions' inputs to the convolution and the scan
(`apply_mask_to_padding_states`), a token-wise product the walk shards with the rest. 32 tokens, 11 of them padding:
rank 1's shard is part padding at P=2; at P=4 rank 2's is part padding and rank 3's is padding only."""
from __future__ import annotations

import pytest

from tests.compiler.exactness import ExactnessRuns, exact_case


def _hf(family: str, padding: int = 0) -> dict:
    return exact_case(builder="tests.compiler.hf_models.build_hf", family=family, seq_len=32, padding=padding)


_FAMILIES = {"mamba": 0, "falcon-mamba": 0, "zamba2": 0, "mamba2-padded": 11, "mamba-padded": 11}

#: name -> (world size, case); one launch per world size runs them all
CASES = {f"{name}-{p}": (p, _hf(name.removesuffix("-padded"), padding)) for p in (2, 4)
         for name, padding in _FAMILIES.items()}


@pytest.fixture(scope="module")
def runs() -> ExactnessRuns:
    return ExactnessRuns(CASES)


@pytest.mark.parametrize("family", ["mamba", "falcon-mamba", "zamba2"])
def test_mamba_families_are_exact_on_two_ranks(runs, family):
    runs.assert_exact(f"{family}-2")


@pytest.mark.parametrize("scan", ["mamba2", "mamba"])
def test_both_scans_are_exact_with_right_padding_on_two_ranks(runs, scan):
    runs.assert_exact(f"{scan}-padded-2")


@pytest.mark.long
@pytest.mark.parametrize("family", ["mamba", "falcon-mamba", "zamba2", "mamba2-padded", "mamba-padded"])
def test_mamba_families_and_padding_are_exact_on_four_ranks(runs, family):
    runs.assert_exact(f"{family}-4")
