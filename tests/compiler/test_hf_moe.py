"""Unmodified HF mixture-of-experts models (and DeepSeek-V3's latent attention) as shipped (default grouped_mm experts, issue 27) against
single-process training: per-rank routing on local expert counts, load-balancing loss made global."""
from __future__ import annotations

import pytest

from tests.compiler.exactness import ExactnessRuns, exact_case


def _hf(family: str, seq_len: int, **compile_options) -> dict:
    return exact_case(builder="tests.compiler.hf_models.build_hf", family=family, seq_len=seq_len,
                      compile_options=compile_options)


#: name -> (world size, case); one launch per world size runs them all. A refusal comes last in its launch
CASES = {
    # output_router_logits=True: histc counts leave the layer in the aux loss (global), 31 tokens: rank 1 padded
    "mixtral-aux-2": (2, _hf("mixtral-aux", 31)),
    # the same through torch.compile(model, backend=autosp.backend(model=model)): the backend installs HF's hooks
    "mixtral-aux-backend-2": (2, _hf("mixtral-aux", 31, entry="backend")),
    "qwen2-moe-2": (2, _hf("qwen2-moe", 32)),  # shared expert with its sigmoid gate beside the routed experts
    "deepseek-v3-2": (2, _hf("deepseek-v3", 32)),  # MLA (latent projections, split rope dims) + routed/shared MoE
    "mixtral-eager-experts-2": (2, _hf("mixtral-eager-experts", 32)),  # the experts loop: refused in one line
    "mixtral-aux-4": (4, _hf("mixtral-aux", 62)),
}


@pytest.fixture(scope="module")
def runs() -> ExactnessRuns:
    return ExactnessRuns(CASES)


@pytest.mark.parametrize("case", ["mixtral-aux-2", "qwen2-moe-2"])
def test_unmodified_hf_moe_with_default_experts_is_exact(runs, case):
    runs.assert_exact(case)


def test_router_logits_through_a_plain_torch_compile_backend_are_exact(runs):
    runs.assert_exact("mixtral-aux-backend-2")


def test_unmodified_hf_deepseek_v3_mla_and_moe_is_exact(runs):
    runs.assert_exact("deepseek-v3-2")


@pytest.mark.long
def test_mixtral_load_balancing_loss_is_exact_on_four_ranks(runs):
    runs.assert_exact("mixtral-aux-4")


def test_hf_eager_experts_loop_is_refused_in_one_line(runs):
    runs.assert_refused("mixtral-eager-experts-2", "modeling_mixtral.py", "experts_implementation")
