"""The project's custom ops live in a namespace of their own (`autosp.comm.library`): a process that has imported
DeepSpeed's compile passes (which register `autosp::all_to_all`, another signature) still compiles AutoSP exactly."""
from __future__ import annotations

import torch

from tests.compiler.exactness import ExactnessRuns, exact_case
from tests.compiler.models import build_decoder


def build_after_deepspeeds_passes(**options) -> torch.nn.Module:
    """The test decoder, built after DeepSpeed's AutoSP compile passes were imported in this (rank) process."""
    import deepspeed.compile.passes.sp_compile  # noqa: F401  (registers DeepSpeed's autosp::all_to_all)

    return build_decoder(**options)


RUNS = ExactnessRuns({"deepspeed-first": (2, exact_case(builder=f"{__name__}.build_after_deepspeeds_passes"))})


def test_deepspeeds_passes_leave_the_projects_ops_alone() -> None:
    import deepspeed.compile.passes.sp_compile  # noqa: F401

    import autosp.comm  # noqa: F401  (the collectives)
    from autosp.comm.library import NAMESPACE, op

    assert NAMESPACE not in ("autosp", "autotp", "deepspeed", "dc", "aten", "prims", "_c10d_functional")
    schema = str(op("all_to_all").default._schema)
    assert schema.startswith(
        f"{NAMESPACE}::all_to_all(Tensor x, SymInt scatter_dim, SymInt gather_dim, SymInt group_size")


def test_autosp_compiles_exactly_after_deepspeeds_passes_in_the_same_process() -> None:
    """Two gloo ranks: DeepSpeed's passes imported, then the decoder compiled by AutoSP (all-to-alls, the loss's
    all-reduce) and trained against single-process training (loss, every gradient, parameters after AdamW steps)."""
    RUNS.assert_exact("deepspeed-first")
