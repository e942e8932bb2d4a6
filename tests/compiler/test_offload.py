"""Activation offload: the layer-boundary values SAC keeps leave the forward graph as host copies and come back
in backward just before their layer (single process, aot_eager), exactly."""
from __future__ import annotations

from functools import partial

import pytest
import torch

from autosp.compiler.memory.offload import parse_offload
from autosp.compiler.options import CompileOptions
from autosp.compiler.pipeline import Compilation, compile_static
from autosp.harness.config import ConfigError
from autosp.harness.measure import CpuAllocationMeter
from autosp.models import build_model, get_preset

SEQ = 128


def _compiled(model: torch.nn.Module, offload: bool):
    """Single process through the pipeline (no SP, no gradient reduction): (compiled, its Compilation records)."""
    options = CompileOptions(sac="sac", backend="aot_eager", offload="activations" if offload else "off")
    compilation = Compilation(options)
    return torch.compile(model, backend=partial(compile_static, compilation), fullgraph=True), compilation


def _measured_step(offload: bool, ids: torch.Tensor):
    """(model after one step, compilation, memory report of the second, measured, step)."""
    model = build_model("tiny")
    compiled, compilation = _compiled(model, offload)
    compiled(input_ids=ids, labels=ids).loss.backward()  # compile outside the measured step
    model.zero_grad(set_to_none=True)
    meter = CpuAllocationMeter()
    with meter.session(), meter.measured_step():
        compiled(input_ids=ids, labels=ids).loss.backward()
    return model, compilation, meter.report()


def test_offloaded_boundaries_are_exact_and_leave_the_device_peak():
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    reference = build_model("tiny")
    reference(input_ids=ids, labels=ids).loss.backward()
    kept, _, kept_memory = _measured_step(False, ids)
    model, compilation, memory = _measured_step(True, ids)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

    (report,) = compilation.graphs[0].offload_reports
    preset = get_preset("tiny")
    # the embedding output and each layer's output: the residual stream entering every layer and the final norm
    assert len(report.values) == preset.num_layers + 1
    assert report.nbytes == (preset.num_layers + 1) * 2 * SEQ * preset.hidden_size * 4
    fw_module, bw_module = compilation.partition_fn.records[0].fw_module, compilation.partition_fn.records[0].bw_module
    targets = [str(n.target) for n in fw_module.graph.nodes] + [str(n.target) for n in bw_module.graph.nodes]
    assert [targets.count(f"autosp_sp.{op}.default") for op in ("offload", "reload", "wait")] == [len(report.values)] * 3

    # the meter books the host copies apart: exactly the offloaded bytes, and the device peak falls
    assert memory.detail["host_offloaded_bytes"] == report.nbytes
    assert kept_memory.detail["host_offloaded_bytes"] == 0
    assert memory.peak_bytes < kept_memory.peak_bytes
    del kept


def test_unknown_offload_value_is_refused_in_one_line():
    assert parse_offload("activations") and not parse_offload("off") and not parse_offload(None)
    with pytest.raises(ConfigError, match="--offload"):
        parse_offload("weights")


def test_the_optimizer_item_rides_beside_the_activations_mode():
    from autosp.compiler.memory.offload import offload_mode, offload_optimizer

    cases = {"optimizer": ("off", "auto"), "activations,optimizer": ("activations", "auto"),
             "auto, optimizer:torch": ("auto", "torch"), "optimizer:deepspeed,off": ("off", "deepspeed"),
             "activations": ("activations", None), None: ("off", None)}
    assert {v: (offload_mode(v), offload_optimizer(v)) for v in cases} == cases
    for bad in ("optimizer,optimizer", "activations,auto", "optimizer:adam"):
        with pytest.raises(ConfigError, match=r"unknown --offload .*activations,optimizer"):
            offload_mode(bad)
