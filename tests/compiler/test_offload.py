"""Activation offload: the layer-boundary values SAC keeps leave the forward graph as host copies and come back
in backward just before their layer (single process, aot_eager), exactly."""
from __future__ import annotations

from functools import partial

import pytest
import torch

from autosp.compiler.memory import OffloadPlan
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
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")

    (report,) = compilation.graphs[0].offload_reports
    preset = get_preset("tiny")
    # the embedding output and each layer's output: the residual stream entering every layer and the final norm
    assert len(report.values) == preset.num_layers + 1
    assert report.nbytes == (preset.num_layers + 1) * 2 * SEQ * preset.hidden_size * 4
    fw_module, bw_module = compilation.partition_fn.records[0].fw_module, compilation.partition_fn.records[0].bw_module
    targets = [str(n.target) for n in fw_module.graph.nodes] + [str(n.target) for n in bw_module.graph.nodes]
    counts = [targets.count(f"autosp_sp.{op}.default") for op in ("offload", "reload", "wait")]
    assert counts == [len(report.values)] * 3

    # the meter books the host copies apart: exactly the offloaded bytes, and the device peak falls
    assert memory.detail["host_offloaded_bytes"] == report.nbytes
    assert kept_memory.detail["host_offloaded_bytes"] == 0
    assert memory.peak_bytes < kept_memory.peak_bytes
    del kept


def test_unknown_offload_value_is_refused_in_one_line():
    assert OffloadPlan.parse("activations").activations == "on"
    assert OffloadPlan.parse("off") == OffloadPlan.parse(None) == OffloadPlan("off", "off", "off")
    with pytest.raises(ConfigError, match="--offload") as info:
        OffloadPlan.parse("weights")
    assert "\n" not in str(info.value)


def test_the_text_parses_once_into_a_plan_and_back():
    """`auto` alone leaves all three to the planner; in a list, what is named is on and the rest off (the meaning
    `auto,optimizer` always had); `<kind>=<mode>` says any mix, and every plan's text parses back to it."""
    cases = {"auto": ("auto", "auto", "auto", "auto"), "optimizer": ("off", "on", "off", "auto"),
             "activations,optimizer": ("on", "on", "off", "auto"),
             "auto, optimizer:torch": ("auto", "on", "off", "torch"),
             "optimizer:deepspeed,off": ("off", "on", "off", "deepspeed"), "activations": ("on", "off", "off", "auto"),
             "activations=auto": ("auto", "off", "off", "auto"), "off,optimizer=auto,params=auto": (
                 "off", "auto", "auto", "auto")}
    for text, fields in cases.items():
        plan = OffloadPlan.parse(text)
        assert (plan.activations, plan.optimizer, plan.params, plan.host_adam) == fields, text
        assert OffloadPlan.parse(str(plan)) == plan and OffloadPlan.parse(plan) is plan
    assert str(OffloadPlan()) == "auto" and str(OffloadPlan("auto", "on", "off")) == "auto,optimizer"
    for bad in ("optimizer,optimizer", "activations,auto", "optimizer:adam", "params:torch", "activations=sometimes"):
        with pytest.raises(ConfigError, match=r"unknown --offload .*activations,optimizer"):
            OffloadPlan.parse(bad)


def test_state_offload_counts_adamws_multi_tensor_temporary_where_torch_steps_that_way(monkeypatch):
    """On CUDA/ROCm torch steps AdamW multi-tensor, with a temporary as large as the second moments: the model state
    that fits (parameters, gradients, two moments: 16 B per fp32 parameter) can still not step there (20 B)."""
    import torch.nn as nn
    import torch.optim.adam as adam

    from autosp.api import state_offload

    model = nn.Linear(100, 100, bias=False)  # 10,000 fp32 parameters
    options = CompileOptions(sac="auto")
    decide = lambda budget: state_offload(options, model, zero=0, group_size=1, device_bytes=budget)  # noqa: E731
    assert decide(160_000).optimizer == "off"  # on CPU: a per-parameter loop, no such temporary
    monkeypatch.setattr(adam, "_default_to_fused_or_foreach", lambda params, differentiable, use_fused=False:
                        (False, True))
    assert decide(199_999).optimizer == "on" and decide(200_000).optimizer == "off"


def test_state_offload_auto_moves_only_what_the_device_cannot_hold():
    """The optimizer state leaves the device only when the model state does not fit it, the parameters only when
    their compute copies and gradients still do not (and only where they may: ZeRO 3 or one rank); no limit, or an
    explicit choice, and nothing is decided."""
    plan = OffloadPlan()

    def resolve(device_bytes, allowed=True, p=plan):
        decided = p.resolve_state(device_bytes=device_bytes, state_bytes=800, optimizer_bytes=800,
                                  compute_state_bytes=400, params_allowed=allowed)
        return decided.optimizer, decided.params

    assert resolve(None) == resolve(1600) == ("off", "off")
    assert resolve(1599) == resolve(400) == ("on", "off")
    assert resolve(399) == ("on", "on") and resolve(399, allowed=False) == ("on", "off")
    assert resolve(1, p=OffloadPlan.parse("auto,optimizer")) == ("on", "off")
    assert resolve(1, p=OffloadPlan.parse("activations=auto")) == ("off", "off")
