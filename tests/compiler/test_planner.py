"""The memory planner (sac auto, the compiler's default) is exact whatever it chooses: P=2 gloo ranks against
single-process training (loss, every gradient, parameters after AdamW) with the planner keeping everything,
moving every saved value to host memory while recomputing every layer whole (its all-to-alls re-run in backward),
and recomputing without host memory.
Each case also asserts the choice was the one named (a case whose plan changed would prove nothing)."""
from __future__ import annotations

import pytest

from tests.compiler.exactness import ExactnessRuns, exact_case

LAYERS = 2
CASES = {
    # no budget on CPU: room to spare, so nothing is recomputed or moved
    "keep": (2, exact_case(layers=LAYERS, compile_options={"sac": "auto"})),
    # one byte fits nothing: every layer recomputed whole (all-to-alls too), what is saved waits in host memory
    "offload and recompute": (2, exact_case(layers=LAYERS, compile_options={"sac": "budget=1B"})),
    # the same without host memory: recompute only
    "recompute": (2, exact_case(layers=LAYERS, compile_options={"sac": "budget=1B", "offload": "off"})),
}


@pytest.fixture(scope="module")
def runs() -> ExactnessRuns:
    return ExactnessRuns(CASES)


def test_the_planner_keeping_everything_is_exact(runs):
    assert runs.assert_exact("keep")["choice"] == {"tokenwise": 0, "attention": 0, "collectives": 0,
                                                   "offloaded_bytes": 0}


def test_the_planner_offloading_and_recomputing_attention_is_exact(runs):
    choice = runs.assert_exact("offload and recompute")["choice"]
    assert choice["tokenwise"] == choice["attention"] == choice["collectives"] == LAYERS, choice
    assert choice["offloaded_bytes"] > 0, choice


def test_the_planner_recomputing_without_host_memory_is_exact(runs):
    choice = runs.assert_exact("recompute")["choice"]
    assert choice == {"tokenwise": LAYERS, "attention": LAYERS, "collectives": LAYERS, "offloaded_bytes": 0}
