"""The compiler's options object: validated once, with one-line errors, shared by compile, backend and make_backend."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import autosp
from autosp.compiler.fx.sizes import parse_size
from autosp.compiler.memory import OffloadPlan, Policy, SacPolicy
from autosp.compiler.options import COMPILE_BACKENDS, CompileOptions
from autosp.errors import AutoSPError, ConfigError, SequenceParallelError


def test_defaults_are_parsed_once_and_the_object_is_frozen() -> None:
    options = CompileOptions()
    # the memory planner by default, deciding the tiling and every offload too
    assert (options.policy, options.tiling_options.enabled, options.tiling_options.planned, options.offloads,
            options.offload_mode, options.offload_plan) == (Policy(SacPolicy.AUTO), False, True, False, "auto",
                                                            OffloadPlan())
    assert CompileOptions(sac="budget=32MiB").policy == Policy(SacPolicy.AUTO, budget_bytes=32 * 2**20)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.sac = "off"  # type: ignore[misc]
    assert COMPILE_BACKENDS == ("inductor", "aot_eager", "eager")


@pytest.mark.parametrize("changes, error, text", [
    (dict(backend="tvm"), SequenceParallelError,
     "unknown inner backend 'tvm'; choose one of inductor, aot_eager, eager"),
    (dict(zero=4), SequenceParallelError, "zero=4: choose a ZeRO stage in [0, 1, 2, 3]"),
    (dict(sac="most"), ConfigError, "unknown --sac policy 'most'"),
    (dict(sac="budget=2"), ConfigError, "--sac budget='2': write a fraction in [0, 1]"),
    (dict(tiling="loss:0"), ConfigError, "the tile size after ':' must be a positive token count"),
    (dict(outputs="logits"), ConfigError, "outputs='logits'"),
    (dict(offload="weights"), ConfigError, "unknown --offload 'weights'"),
    (dict(offload="activations", backend="eager"), SequenceParallelError, "use backend aot_eager or inductor"),
    (dict(ulysses_size=0), SequenceParallelError, "ulysses_size=0: give a positive rank count"),
    (dict(attention_chunks=0), SequenceParallelError, "attention_chunks=0: give a positive number of chunks"),
    (dict(host_budget=-1), SequenceParallelError, "host_budget=-1: give bytes of host memory"),
    (dict(compute_dtype=torch.int8), SequenceParallelError, "compute_dtype=torch.int8"),
])
def test_each_bad_value_is_one_line_naming_it(changes, error, text) -> None:
    with pytest.raises(error) as caught:
        CompileOptions(**changes)
    assert text in str(caught.value) and "\n" not in str(caught.value)


def test_compile_takes_an_options_object_and_keywords_over_it_before_anything_else() -> None:
    """Checked before the process group is looked for: no torch.distributed here, and the option is what fails."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="unknown --sac policy"):
        autosp.compile(model, options=CompileOptions(backend="aot_eager"), sac="most")
    with pytest.raises(TypeError, match="unknown AutoSP option 'inner'"):
        autosp.compile(model, inner="aot_eager")
    with pytest.raises(SequenceParallelError, match="use autosp.compile for zero=, compute_dtype= or offload="):
        autosp.backend(zero=3)
    with pytest.raises(SequenceParallelError, match="offload=optimizer"):
        autosp.backend(offload="activations,optimizer")
    assert CompileOptions.of(CompileOptions(tiling="loss"), sac="off") == CompileOptions(tiling="loss", sac="off")


def test_one_size_parser_for_the_compiler_and_the_harness() -> None:
    from autosp.harness import measure

    assert measure.parse_size is parse_size
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size("800MB") == 800 * 10**6 and parse_size(4096) == 4096
    with pytest.raises(AutoSPError, match="cannot read the size"):
        parse_size("lots")
