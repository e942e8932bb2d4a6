"""Correctness check: a method on P ranks against single-process training, same model, seed and global batches.

Both sides build the model from the same seed and train `steps` AdamW steps on the same global batches (a new
seeded batch per step, so a method that caches data-dependent state between steps is caught). After every step
we compare the loss, every parameter's full gradient and every parameter after the optimizer step.

Error measure: the norm-wise relative error ||x - ref|| / ||ref|| per parameter (per step), reported as the worst
over the parameters of each group (embeddings, attention, mlp, norms, lm_head) and over steps.

Why DEFAULT_TOLERANCE = 1e-4 in fp32: a correct parallel method computes the same sums in another order (loss and
gradients summed over sequence shards and data-parallel ranks, attention reassembled by all-to-all, other
kernels). fp32 has eps = 1.2e-7, and rounding differences of reordered sums grow like sqrt(n) * eps over n
terms, amplified somewhat through the layers: correct methods land at 1e-7 .. 1e-5 on the CPU presets. Real
bugs are orders of magnitude larger: a missing or doubled gradient reduction is O(1), a per-shard instead of a
global token mean is ~1e-2 with uneven ignored labels, a wrong RoPE offset or a misrouted head is O(1e-1).
1e-4 leaves an order of magnitude above the reordering noise and two below the smallest bug class.
Low-precision dtypes get looser, uncalibrated defaults (see `default_tolerance`).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autosp.harness.config import RunConfig
from autosp.harness.launch import launch
from autosp.harness.runner import build_train_step, global_batch, validate

DEFAULT_TOLERANCE = 1e-4
_LOW_PRECISION_TOLERANCE = {"bfloat16": 3e-2, "float16": 1e-2}
GROUPS = ("embeddings", "attention", "mlp", "norms", "lm_head", "other")
DEFAULT_STEPS = 2


def default_tolerance(dtype: str) -> float:
    return _LOW_PRECISION_TOLERANCE.get(dtype, DEFAULT_TOLERANCE)


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        """A human-readable table: worst relative error per group, the losses, the verdict."""
        head = (f"check {self.method}: {self.world_size} rank(s), sp {self.sp_size}, {self.steps} AdamW step(s) vs "
                f"single process; tolerance {self.tolerance:.0e}")
        if self.status != "ok" or not self.grad_errors:
            return f"{head}\nFAILED: {self.status}: {self.error}"
        lines = [head, f"{'group':<12}{'gradient':>12}{'parameters':>12}"]
        for group in GROUPS:
            if group in self.grad_errors:
                lines.append(f"{group:<12}{self.grad_errors[group]:>12.2e}{self.param_errors[group]:>12.2e}")
        lines.append("loss        " + "  ".join(f"step {i}: {m:.6f} vs {r:.6f} (rel {e:.1e})" for i, (m, r, e)
                                             in enumerate(zip(self.losses, self.reference_losses, self.loss_errors))))
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
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return trace if rank == 0 else None


def reference_config(cfg: RunConfig, sp_size: int) -> RunConfig:
    """Single-process training of the same global batch: dp_size * batch_size rows on one rank."""
    return cfg.replace(method="single", world_size=1, sp_size=None,
                       batch_size=(cfg.world_size // sp_size) * cfg.batch_size)


def compare(trace: dict[str, Any], reference: dict[str, Any], report: CheckReport) -> CheckReport:
    """Fill `report` with the errors of `trace` against `reference` and decide `passed`."""
    report.losses, report.reference_losses = trace["losses"], reference["losses"]
    report.loss_errors = [abs(m - r) / max(abs(r), 1e-30) for m, r in zip(trace["losses"], reference["losses"])]
    problems = []
    for kind, errors, worst in (("grads", report.grad_errors, report.worst_grad),
                                ("params", report.param_errors, report.worst_param)):
        for step, (mine, ref) in enumerate(zip(trace[kind], reference[kind])):
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
    report.passed = (not problems and worst_loss <= report.tolerance and report.worst_grad.error <= report.tolerance
                     and report.worst_param.error <= report.tolerance)
    report.error = "; ".join(problems) or None
    return report


def check(cfg: RunConfig, *, tolerance: float | None = None, steps: int = DEFAULT_STEPS,
          extra_imports: Iterable[str] = ()) -> CheckReport:
    """Run `cfg.method` on `cfg.world_size` ranks and single-process training; compare (see module docstring).

    Bad configurations raise ConfigError; a method that crashes, hangs or runs out of memory fails the check
    with that status.
    """
    extra_imports = tuple(extra_imports)
    _, sp_size = validate(cfg, extra_imports)
    report = CheckReport(cfg.method, cfg.world_size, sp_size, steps,
                         tolerance if tolerance is not None else default_tolerance(cfg.dtype), passed=False)
    traces = []
    for run_cfg in (cfg, reference_config(cfg, sp_size)):
        outcome = launch(trace_rank, (run_cfg.to_dict(), extra_imports, steps), world_size=run_cfg.world_size,
                         device=run_cfg.device, timeout_s=run_cfg.timeout_s)
        if outcome.status != "ok":
            who = "the method" if run_cfg is cfg else "the single-process reference"
            report.status, report.error = outcome.status, f"{who}: {outcome.error}"
            return report
        traces.append(outcome.results[0])
    return compare(traces[0], traces[1], report)
