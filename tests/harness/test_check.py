import math

import pytest
import torch

from autosp.harness.check import (
    SPREAD_FACTOR,
    CheckReport,
    check,
    check_many,
    compare,
    parameter_group,
    relative_error,
    spread_bounds,
)
from autosp.harness.config import ConfigError, DataConfig, RunConfig
from autosp.harness.precision import precision_of

PERTURBED_MODULE = "tests.perturbed_method"


def _cfg(method: str = "single", **kw) -> RunConfig:
    return RunConfig(method=method, model="tiny", seq_len=128, timeout_s=120, **kw)


def test_single_passes_with_zero_error_on_awkward_data() -> None:
    data = DataConfig(ignore_fraction=0.3, packed_documents=3, pad_fraction=0.1)
    report = check(_cfg(batch_size=2, data=data))
    assert report.passed, report.format()
    assert report.steps == 2 and len(report.loss_errors) == 2
    assert set(report.grad_errors) == {"embeddings", "attention", "mlp", "norms", "lm_head"}
    assert max(report.grad_errors.values()) == 0.0 and max(report.param_errors.values()) == 0.0


def test_perturbed_gradient_fails() -> None:
    report = check(_cfg("single-perturbed"), steps=1, extra_imports=[PERTURBED_MODULE])
    assert not report.passed
    assert report.worst_grad.parameter == "model.layers.1.mlp.up_proj.weight"
    assert 5e-4 < report.worst_grad.error < 2e-3  # the 1e-3 nudge is seen at its size
    assert report.grad_errors["attention"] == 0.0  # one step: nothing else differs
    assert "FAILED" in report.format()


def test_relative_error() -> None:
    ref = torch.tensor([3.0, 4.0])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(ref + torch.tensor([0.0, 0.5]), ref) == pytest.approx(0.1)
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_error(torch.ones(2), torch.zeros(2)) == math.inf
    assert relative_error(torch.ones(3), ref) == math.inf


@pytest.mark.parametrize("name,group", [
    ("model.embed_tokens.weight", "embeddings"), ("model.layers.0.self_attn.q_proj.weight", "attention"),
    ("model.layers.0.mlp.gate_proj.weight", "mlp"), ("model.layers.0.input_layernorm.weight", "norms"),
    ("model.norm.weight", "norms"), ("lm_head.weight", "lm_head")])
def test_parameter_groups(name: str, group: str) -> None:
    assert parameter_group(name) == group


def _trace(loss: float, grad: torch.Tensor) -> dict:
    return {"losses": [loss], "grads": [{"lm_head.weight": grad}], "params": [{"lm_head.weight": grad * 2}]}


def test_compare_flags_loss_and_missing_parameters() -> None:
    ref = _trace(2.0, torch.ones(4))
    report = compare(_trace(2.0 * (1 + 1e-3), torch.ones(4)), ref, CheckReport("m", 2, 2, 1, 1e-4, False))
    assert not report.passed and report.loss_errors[0] == pytest.approx(1e-3)
    missing = {"losses": [2.0], "grads": [{}], "params": [{}]}
    report = compare(missing, ref, CheckReport("m", 2, 2, 1, 1e-4, False))
    assert not report.passed and "missing ['lm_head.weight']" in report.error
    assert compare(ref, ref, CheckReport("m", 2, 2, 1, 1e-4, False)).passed


def test_low_precision_bounds_come_from_the_reference_spread_per_group() -> None:
    """bf16: the method may err against fp32 up to SPREAD_FACTOR x the bf16 single process's own error, per group."""
    fp32 = _trace(2.0, torch.ones(4))
    same_precision = _trace(2.0 * (1 + 1e-3), torch.tensor([1.0, 1.0, 1.0, 1.02]))  # grad error 1e-2, loss 1e-3
    spread = compare(same_precision, fp32, CheckReport("single", 1, 1, 1, 1e-4, False))
    bounds = spread_bounds(spread, floor=1e-4)
    assert bounds["grads"]["lm_head"] == pytest.approx(SPREAD_FACTOR * 1e-2)
    assert bounds["loss"]["loss"] == pytest.approx(SPREAD_FACTOR * 1e-3)

    def report() -> CheckReport:
        return CheckReport("m", 2, 2, 1, 1e-4, False, bounds=bounds)

    within = _trace(2.0 * (1 - 2e-3), torch.tensor([1.0, 1.0, 0.97, 1.0]))  # 1.5x, 2x the spread
    assert compare(within, fp32, report()).passed
    beyond = _trace(2.0, torch.tensor([1.0, 1.0, 1.0, 1.1]))  # 5x the gradient spread
    assert not compare(beyond, fp32, report()).passed
    assert "[4.0e-02]" in compare(beyond, fp32, report()).format()


def test_precision_names() -> None:
    assert precision_of("bfloat16").mixed and precision_of("bfloat16").label == "bfloat16-mixed"
    assert precision_of("bfloat16").state == torch.float32 and precision_of("bfloat16").compute == torch.bfloat16
    assert precision_of("bfloat16-pure").label == "bfloat16-pure" and precision_of("float32").label == "float32"
    with pytest.raises(ConfigError, match="dynamic loss scaling"):
        precision_of("float16")
    with pytest.raises(ConfigError, match="unknown --dtype 'int8'"):
        precision_of("int8")


def test_checks_of_the_same_training_share_one_reference_process(monkeypatch) -> None:
    """The suite runs ~40 checks; those whose single-process training is the same (they differ only in the method,
    its stage, backend or policy) reuse the reference traced by the first instead of starting a process each."""
    from collections import OrderedDict
    from types import SimpleNamespace

    import autosp.harness.check as checking

    started = []

    def fake_launch(body, args, world_size, **_):
        started.append(body.__name__)
        trace = {"losses": [1.0], "grads": [{"w": torch.ones(2)}], "params": [{"w": torch.ones(2)}]}
        results = [[trace] * len(args[0])] if body is checking.trace_references else [trace]
        return SimpleNamespace(status="ok", results=results, error=None)

    monkeypatch.setattr(checking, "launch", fake_launch)
    monkeypatch.setattr(checking, "_REFERENCES", OrderedDict())
    cfg = _cfg("autosp", world_size=2, zero=0)
    assert check(cfg, steps=1).passed
    assert check(cfg.replace(zero=3, sac="off", compile_backend="aot_eager"), steps=1).passed
    assert check(cfg.replace(data=DataConfig(ignore_fraction=0.3)), steps=1).passed  # other data: other training
    assert started == ["trace_rank", "trace_references", "trace_rank", "trace_rank", "trace_references"]


def test_checks_of_one_world_size_share_one_launch_and_a_failed_one_is_checked_one_by_one(monkeypatch) -> None:
    """`check_many`: every reference in one process, the configurations of one world size in one launch (a world size
    with one configuration in a launch of its own); where a shared launch fails, each of its configurations is
    checked in a launch of its own, so that its failure reads as `check`'s."""
    from collections import OrderedDict
    from types import SimpleNamespace

    import autosp.harness.check as checking

    started, shared_fails = [], []
    trace = {"losses": [1.0], "grads": [{"w": torch.ones(2)}], "params": [{"w": torch.ones(2)}]}

    def fake_launch(body, args, world_size, **_):
        started.append((body.__name__, world_size))
        if body is checking.trace_ranks and shared_fails:
            return SimpleNamespace(status="error", results=[None] * world_size, error="rank 1: RuntimeError: boom")
        many = body in (checking.trace_references, checking.trace_ranks)
        return SimpleNamespace(status="ok", results=[[trace] * len(args[0]) if many else trace], error=None)

    monkeypatch.setattr(checking, "launch", fake_launch)
    monkeypatch.setattr(checking, "_REFERENCES", OrderedDict())
    cfg = _cfg("autosp", world_size=2, zero=0)
    cfgs = [cfg, cfg.replace(zero=3), cfg.replace(world_size=4), cfg.replace(data=DataConfig(ignore_fraction=0.3))]
    reports = check_many(cfgs, steps=1)
    assert all(r.passed for r in reports) and [r.world_size for r in reports] == [2, 2, 4, 2]
    assert started == [("trace_references", 1), ("trace_ranks", 2), ("trace_rank", 4)]
    started.clear()
    shared_fails.append(True)
    assert all(r.passed for r in check_many(cfgs, steps=1))  # the references traced above are reused
    assert started == [("trace_ranks", 2)] + [("trace_rank", 2)] * 3 + [("trace_rank", 4)]
