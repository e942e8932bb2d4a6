"""Unmodified HF models of the newest attention (issue 46) against single-process training at P=2 and P=4, ZeRO 0
and 3: Granite SWA's sink gate, `sigmoid(logsumexp(scores) - sink)` on the attention's output, inside the
hand-written attention region (per head and query once the all-to-all gave this rank every key of its heads);
DeepSeek sparse attention (DeepSeek-V3.2, GLM-MoE-DSA): the indexer's keys and MLA's latent gathered, each rank's
queries selecting and attending over every key."""
from __future__ import annotations

import pytest

from tests.compiler.exactness import ExactnessRuns, exact_case


def _hf(family: str, seq_len: int, **compile_options) -> dict:
    return exact_case(builder="tests.compiler.hf_models.build_hf", family=family, seq_len=seq_len,
                      compile_options=compile_options)


#: name -> (world size, case); one launch per world size runs them all
CASES = {
    "granite-swa-2": (2, _hf("granite-swa", 31)),  # rank 1 padded: the logsumexp must not see the padded keys
    "granite-swa-zero3-2": (2, _hf("granite-swa", 32, zero=3)),
    "granitemoe-swa-2": (2, _hf("granitemoe-swa", 32)),
    "granitemoe-swa-planner-2": (2, _hf("granitemoe-swa", 32, sac="auto")),  # the memory planner and tiling on
    "deepseek-v32-2": (2, _hf("deepseek-v32", 32)),
    "deepseek-v32-zero3-2": (2, _hf("deepseek-v32", 32, zero=3)),
    "glm-moe-dsa-planner-2": (2, _hf("glm-moe-dsa", 32, sac="auto")),
    "deepseek-v32-padded-2": (2, _hf("deepseek-v32", 31)),  # refused: a padded query row selects no key
    "granite-swa-4": (4, _hf("granite-swa", 62)),
    "granitemoe-swa-zero3-4": (4, _hf("granitemoe-swa", 64, zero=3)),
    "deepseek-v32-4": (4, _hf("deepseek-v32", 64)),
    "glm-moe-dsa-zero3-4": (4, _hf("glm-moe-dsa", 64, zero=3)),
}
SINKS = [c for c in CASES if c.startswith("granite")]
SPARSE = [c for c in CASES if c.startswith(("deepseek", "glm")) and "padded" not in c]


@pytest.fixture(scope="module")
def runs() -> ExactnessRuns:
    return ExactnessRuns(CASES)


@pytest.mark.parametrize("case", SINKS)
def test_sink_gates_through_logsumexp_are_exact(runs, case):
    runs.assert_exact(case)


@pytest.mark.parametrize("case", SPARSE)
def test_deepseek_sparse_attention_is_exact(runs, case):
    runs.assert_exact(case)


def test_deepseek_sparse_attention_with_a_padded_shard_is_refused_naming_the_attention(runs):
    runs.assert_refused("deepseek-v32-padded-2", "attention model.layers.0.self_attn",
                        "DeepSeek sparse attention needs the sequence length (31) divisible by the SP degree 2")
