"""Correctness check: a method on P ranks against single-process training, same model, seed and global batches.

Both sides train `steps` AdamW steps on the same seeded global batches (a new batch per step, so state cached
between steps is caught) and compare the loss, every parameter's full gradient and every parameter after the
step, as the norm-wise relative error per parameter, reported as the worst per group (embeddings, attention,
mlp, norms, lm_head) and step.

fp32 passes below DEFAULT_TOLERANCE = 1e-4: reordered sums of a correct method land at 1e-7..1e-5, the smallest
bug class (a per-shard token mean) at ~1e-2. Other dtypes are checked against the fp32 reference within
SPREAD_FACTOR times the error of single-process training in the same precision (bf16 has no fixed right bound).
The reasoning in full: docs/harness.md, "How `check` decides".
"""
from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autosp.harness.config import METHOD_OPTIONS, RunConfig
from autosp.harness.launch import LaunchResult, launch
from autosp.harness.runner import build_train_step, global_batch, validate

DEFAULT_TOLERANCE = 1e-4
#: a low-precision method may err against fp32 by this many times the single-process run in its precision
SPREAD_FACTOR = 4.0
GROUPS = ("embeddings", "attention", "mlp", "norms", "lm_head", "other")
DEFAULT_STEPS = 2
KINDS = ("loss", "grads", "params")
#: RunConfig fields single-process training does not read (the method options, and how a run is bounded and timed):
#: checks that differ only in them train the same reference
METHOD_ONLY_FIELDS = (*METHOD_OPTIONS, "memory_budget", "timeout_s", "steps", "warmup")
#: the last few reference traces of this process (single-process training is deterministic for a configuration), so
#: a process running many checks (the test suite) starts one reference process per distinct reference, not per check
_REFERENCES: OrderedDict[str, dict[str, Any]] = OrderedDict()
_REFERENCES_KEPT = 16


def calibrated(dtype: str) -> bool:
    """Checked against fp32 with a tolerance from the reference spread (every dtype but float32)."""
    return dtype != "float32"


def parameter_group(name: str) -> str:
    """Which group a parameter name belongs to (project Llama and HF Llama share the naming)."""
    if "embed" in name:
        return "embeddings"
    if "norm" in name:
        return "norms"
    if "lm_head" in name:
        return "lm_head"
    if "attn" in name or "attention" in name:
        return "attention"
    if "mlp" in name:
        return "mlp"
    return "other"


@dataclass
class Worst:
    """The largest relative error of one kind: its value, the parameter and the step it occurred at."""

    error: float = 0.0
    parameter: str | None = None
    step: int | None = None


@dataclass
class CheckReport:
    method: str
    world_size: int
    sp_size: int
    steps: int
    tolerance: float
    passed: bool
    status: str = "ok"  # the launch status of the method's run, then of the reference's (ok|oom|timeout|error)
    error: str | None = None
    loss_errors: list[float] = field(default_factory=list)  # per step
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    grad_errors: dict[str, float] = field(default_factory=dict)  # group -> worst over its parameters and steps
    param_errors: dict[str, float] = field(default_factory=dict)
    worst_grad: Worst = field(default_factory=Worst)
    worst_param: Worst = field(default_factory=Worst)
    #: low precision: kind (loss | grads | params) -> group (or "loss") -> the same-precision single-process
    #: run's error against fp32, and the bound derived from it (SPREAD_FACTOR x, at least `tolerance`)
    reference_spread: dict[str, dict[str, float]] = field(default_factory=dict)
    #: the memory planner's plan per compiled graph of the method (autosp's `extra.sac_auto`): what was checked
    plans: list[dict[str, Any]] = field(default_factory=list)
    bounds: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        """A human-readable table: worst relative error per group, the losses, the verdict."""
        head = (f"check {self.method}: {self.world_size} rank(s), sp {self.sp_size}, {self.steps} AdamW step(s) vs "
                f"single process; tolerance {self.tolerance:.0e}")
        if self.status != "ok" or not self.grad_errors:
            return f"{head}\nFAILED: {self.status}: {self.error}"
        if self.bounds:
            head += (f" (per group: {SPREAD_FACTOR:g} x the same-precision single process's error vs fp32, "
                     f"at least {self.tolerance:.0e}; bound in brackets)")
        lines = [head, f"{'group':<12}{'gradient':>12}{'parameters':>12}"]

        def cell(kind: str, group: str, value: float) -> str:
            bound = self.bounds.get(kind, {}).get(group)
            return f"{value:>12.2e}" + (f" [{bound:.1e}]" if bound is not None else "")

        for group in GROUPS:
            if group in self.grad_errors:
                lines.append(f"{group:<12}{cell('grads', group, self.grad_errors[group])}"
                             f"{cell('params', group, self.param_errors[group])}")
        steps = enumerate(zip(self.losses, self.reference_losses, self.loss_errors, strict=True))
        lines.append("loss        " + "  ".join(f"step {i}: {m:.6f} vs {r:.6f} (rel {e:.1e})" for i, (m, r, e) in steps)
                     + (f" [{self.bounds['loss']['loss']:.1e}]" if self.bounds else ""))
        verdict = "PASSED" if self.passed else "FAILED"
        lines.append(f"{verdict}: worst gradient {self.worst_grad.error:.2e} ({self.worst_grad.parameter}, step "
                     f"{self.worst_grad.step}); worst parameter {self.worst_param.error:.2e} "
                     f"({self.worst_param.parameter}, step {self.worst_param.step})")
        if self.error:
            lines.append(self.error)
        return "\n".join(lines)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference|| in float64 (0 when both are zero; inf for a shape mismatch)."""
    if value.shape != reference.shape:
        return math.inf
    value, reference = value.double(), reference.double()
    diff = float((value - reference).norm())
    scale = float(reference.norm())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def trace_rank(cfg_dict: dict[str, Any], extra_imports: tuple[str, ...], steps: int) -> dict[str, Any] | None:
    """Rank body: `steps` steps; rank 0 returns losses, full gradients and full parameters after each step."""
    cfg = RunConfig.from_dict(cfg_dict)
    strategy, sp_size = validate(cfg, extra_imports)
    train_step, device = build_train_step(cfg, strategy, sp_size)
    trace: dict[str, list] = {"losses": [], "grads": [], "params": []}
    for step in range(steps):
        batch = global_batch(cfg, sp_size, step).to(device)
        trace["losses"].append(float(train_step.forward_backward(batch)))
        trace["grads"].append(train_step.full_gradients())  # collective: every rank takes part
        train_step.optimizer_step()
        trace["params"].append(train_step.full_parameters())
    trace["plans"] = train_step.metrics().get("sac_auto", [])  # what autosp's memory planner chose: what was checked
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return trace if rank == 0 else None


def trace_references(cfg_dicts: list[dict[str, Any]], extra_imports: tuple[str, ...], steps: int) -> list[dict]:
    """Body of the one single-process reference rank: `trace_rank` of each config in turn (one process start)."""
    return [trace_rank(cfg_dict, extra_imports, steps) for cfg_dict in cfg_dicts]


def reference_key(reference: RunConfig, extra_imports: tuple[str, ...], steps: int) -> str:
    """What a reference trace depends on: its configuration but for METHOD_ONLY_FIELDS, the imports, the steps."""
    fields = {k: v for k, v in reference.to_dict().items() if k not in METHOD_ONLY_FIELDS}
    return json.dumps([fields, sorted(extra_imports), steps], sort_keys=True, default=str)


def reference_config(cfg: RunConfig, sp_size: int) -> RunConfig:
    """Single-process training of the same global batch: dp_size * batch_size rows on one rank."""
    return cfg.replace(method="single", world_size=1, sp_size=None,
                       batch_size=(cfg.world_size // sp_size) * cfg.batch_size)


def spread_bounds(spread: CheckReport, floor: float) -> dict[str, dict[str, float]]:
    """SPREAD_FACTOR x the reference spread per kind and group, never below `floor` (see the module docstring)."""
    def bound(error: float) -> float:
        return SPREAD_FACTOR * max(error, floor)

    return {"loss": {"loss": bound(max(spread.loss_errors, default=0.0))},
            "grads": {g: bound(e) for g, e in spread.grad_errors.items()},
            "params": {g: bound(e) for g, e in spread.param_errors.items()}}


def compare(trace: dict[str, Any], reference: dict[str, Any], report: CheckReport) -> CheckReport:
    """Fill `report` with the errors of `trace` against `reference` and decide `passed`: every error within
    `report.bounds` where given (per kind and group), else within `report.tolerance`."""
    report.losses, report.reference_losses = trace["losses"], reference["losses"]
    report.loss_errors = [abs(m - r) / max(abs(r), 1e-30)
                          for m, r in zip(trace["losses"], reference["losses"], strict=True)]
    problems = []
    for kind, errors, worst in (("grads", report.grad_errors, report.worst_grad),
                                ("params", report.param_errors, report.worst_param)):
        for step, (mine, ref) in enumerate(zip(trace[kind], reference[kind], strict=True)):
            if mine.keys() != ref.keys():
                missing, unexpected = sorted(ref.keys() - mine.keys()), sorted(mine.keys() - ref.keys())
                problems.append(f"step {step} {kind}: missing {missing[:3]}, unexpected {unexpected[:3]}")
            for name in ref.keys() & mine.keys():
                err = relative_error(mine[name], ref[name])
                group = parameter_group(name)
                errors[group] = max(errors.get(group, 0.0), err)
                if err > worst.error or worst.parameter is None:
                    worst.error, worst.parameter, worst.step = err, name, step
    worst_loss = max(report.loss_errors, default=math.inf)

    def within(kind: str, group: str, error: float) -> bool:
        return error <= report.bounds.get(kind, {}).get(group, report.tolerance)

    report.passed = (not problems and within("loss", "loss", worst_loss)
                     and all(within("grads", g, e) for g, e in report.grad_errors.items())
                     and all(within("params", g, e) for g, e in report.param_errors.items()))
    report.error = "; ".join(problems) or None
    return report


def check(cfg: RunConfig, *, tolerance: float | None = None, steps: int = DEFAULT_STEPS,
          extra_imports: Iterable[str] = ()) -> CheckReport:
    """Run `cfg.method` on `cfg.world_size` ranks and single-process training; compare (see module docstring).

    In fp32 every error must be within `tolerance` (default 1e-4). In any other precision the method is compared
    with fp32 single-process training, within SPREAD_FACTOR x the same-precision single process's own error per
    kind and group; an explicit `tolerance` then replaces that bound's floor. Bad configurations raise
    ConfigError; a method that crashes, hangs or runs out of memory fails the check with that status.
    """
    extra_imports = tuple(extra_imports)
    _, sp_size = validate(cfg, extra_imports)
    report = CheckReport(cfg.method, cfg.world_size, sp_size, steps,
                         tolerance if tolerance is not None else DEFAULT_TOLERANCE, passed=False)
    method = launch(trace_rank, (cfg.to_dict(), extra_imports, steps), world_size=cfg.world_size, device=cfg.device,
                    timeout_s=cfg.timeout_s)
    if method.status != "ok":
        report.status, report.error = method.status, f"the method: {method.error}"
        return report
    references = _references(cfg, sp_size)
    outcome = _trace_references(references, extra_imports, steps, cfg.device, cfg.timeout_s)
    if outcome is not None:
        report.status, report.error = outcome.status, f"the single-process reference: {outcome.error}"
        return report
    return _compared(cfg, method.results[0], [_REFERENCES[reference_key(r, extra_imports, steps)] for r in references],
                     report)


def check_many(cfgs: list[RunConfig], *, steps: int = DEFAULT_STEPS,
               extra_imports: Iterable[str] = ()) -> list[CheckReport]:
    """`check` of each configuration (default tolerance), those of one world size and device traced one after another
    in one launch, each compiled afresh (the ranks start, import and first compile once, not once per
    configuration), and every reference not traced yet in one process. Where a shared launch fails, each of its
    configurations is checked in a launch of its own, so that a failure is reported as `check` reports it."""
    extra_imports = tuple(extra_imports)
    sp_sizes = [validate(cfg, extra_imports)[1] for cfg in cfgs]
    references = {reference_key(r, extra_imports, steps): r
                  for cfg, sp_size in zip(cfgs, sp_sizes, strict=True) for r in _references(cfg, sp_size)}
    traced = _trace_references(list(references.values()), extra_imports, steps, cfgs[0].device,
                               sum(cfg.timeout_s for cfg in cfgs)) if cfgs else None
    # held here for the whole batch: the process-wide cache keeps only the last _REFERENCES_KEPT
    traces = {key: _REFERENCES[key] for key in references} if traced is None else {}
    groups: dict[tuple[int, str], list[int]] = {}
    for i, cfg in enumerate(cfgs):
        groups.setdefault((cfg.world_size, cfg.device), []).append(i)
    reports: list[CheckReport | None] = [None] * len(cfgs)
    for (world_size, device), members in groups.items():
        method = None
        if len(members) > 1 and traced is None:
            method = launch(trace_ranks, ([cfgs[i].to_dict() for i in members], extra_imports, steps),
                            world_size=world_size, device=device, timeout_s=sum(cfgs[i].timeout_s for i in members))
        for position, i in enumerate(members):
            if method is None or method.status != "ok":
                reports[i] = check(cfgs[i], steps=steps, extra_imports=extra_imports)
                continue
            report = CheckReport(cfgs[i].method, cfgs[i].world_size, sp_sizes[i], steps, DEFAULT_TOLERANCE,
                                 passed=False)
            keys = [reference_key(r, extra_imports, steps) for r in _references(cfgs[i], sp_sizes[i])]
            reports[i] = _compared(cfgs[i], method.results[0][position], [traces[key] for key in keys], report)
    return reports


def trace_ranks(cfg_dicts: list[dict[str, Any]], extra_imports: tuple[str, ...], steps: int) -> list[dict | None]:
    """Rank body of `check_many`: `trace_rank` of each configuration in turn, each compiled afresh."""
    traces = []
    for cfg_dict in cfg_dicts:
        torch._dynamo.reset()
        traces.append(trace_rank(cfg_dict, extra_imports, steps))
    return traces


def _references(cfg: RunConfig, sp_size: int) -> list[RunConfig]:
    """The references share one process: fp32, then (low precision) the same precision as the method."""
    reference = reference_config(cfg, sp_size)
    return [reference.replace(dtype="float32")] + ([reference] if calibrated(cfg.dtype) else [])


def _trace_references(references: list[RunConfig], extra_imports: tuple[str, ...], steps: int, device: str,
                      timeout_s: float) -> LaunchResult | None:
    """Trace, in one process, the references this one has not traced yet, into `_REFERENCES` (the last
    _REFERENCES_KEPT kept, the ones asked for last); None, or the failed launch."""
    missing = [r for r in references if reference_key(r, extra_imports, steps) not in _REFERENCES]
    if missing:
        outcome = launch(trace_references, ([r.to_dict() for r in missing], extra_imports, steps), world_size=1,
                         device=device, timeout_s=timeout_s)
        if outcome.status != "ok":
            return outcome
        _REFERENCES.update((reference_key(r, extra_imports, steps), t)
                           for r, t in zip(missing, outcome.results[0], strict=True))
    for r in references:
        _REFERENCES.move_to_end(reference_key(r, extra_imports, steps))
    while len(_REFERENCES) > max(_REFERENCES_KEPT, len(references)):
        _REFERENCES.popitem(last=False)
    return None


def _compared(cfg: RunConfig, trace: dict[str, Any], references: list[dict[str, Any]],
              report: CheckReport) -> CheckReport:
    """`report` filled with the method's trace against the fp32 reference (and, in low precision, bounded by the
    same-precision reference's spread)."""
    if calibrated(cfg.dtype):
        spread = compare(references[1], references[0],
                         CheckReport("single", 1, 1, report.steps, report.tolerance, passed=False))
        report.reference_spread = {"loss": {"loss": max(spread.loss_errors)}, "grads": spread.grad_errors,
                                   "params": spread.param_errors}
        report.bounds = spread_bounds(spread, report.tolerance)
    report.plans = trace.get("plans", [])
    return compare(trace, references[0], report)
