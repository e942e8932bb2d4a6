"""The checkpointing policies (`--sac`, `CompileOptions.sac`) and their parser; what each policy does is in
`autosp.compiler.memory.partitioner`."""
from __future__ import annotations

from dataclasses import dataclass

from autosp.compiler.fx.sizes import UNITS, split_size
from autosp.errors import ConfigError


class SacPolicy:
    """The policy kinds (``Policy.kind``)."""

    OFF = "off"
    SAC = "sac"
    FULL = "full"
    BUDGET = "budget"
    AUTO = "auto"


@dataclass(frozen=True)
class Policy:
    """A parsed ``--sac`` value. ``budget`` (a fraction) is only set for kind ``budget``; ``budget_bytes`` only
    for kind ``auto`` (None: the budget is the device's free memory at compile time, unlimited on CPU)."""

    kind: str
    budget: float | None = None
    budget_bytes: int | None = None

    def __str__(self) -> str:
        if self.kind == SacPolicy.BUDGET:
            return f"budget={self.budget:g}"
        if self.kind == SacPolicy.AUTO and self.budget_bytes is not None:
            return f"budget={self.budget_bytes}B"
        return self.kind


POLICY_CHOICES = "off, sac, full, auto, budget=<fraction in [0, 1]> or budget=<bytes, e.g. 32MiB>"


def parse_policy(value: str | bool | Policy | None) -> Policy:
    """``off | sac | full | auto | budget=<fraction in [0, 1]> | budget=<bytes with a unit, e.g. 32MiB>``
    (a byte budget is kind ``auto`` with that budget); True/False/None map to sac/off/off."""
    if isinstance(value, Policy):
        return value
    if value is None or value is False:
        return Policy(SacPolicy.OFF)
    if value is True:
        return Policy(SacPolicy.SAC)
    text = str(value).strip().lower()
    if text in (SacPolicy.OFF, SacPolicy.SAC, SacPolicy.FULL, SacPolicy.AUTO):
        return Policy(text)
    if text.startswith("budget="):
        raw = text.removeprefix("budget=").replace(" ", "")
        size = split_size(raw)
        if size is not None and size[1]:  # a unit: bytes (a bare number is a fraction)
            return Policy(SacPolicy.AUTO, budget_bytes=int(size[0] * UNITS[size[1]]))
        try:
            fraction = float(raw)
        except ValueError:
            fraction = float("nan")
        if not 0.0 <= fraction <= 1.0:  # also rejects nan
            raise ConfigError(f"--sac budget={raw!r}: write a fraction in [0, 1] (budget=0.5) or bytes with a unit "
                              "(budget=32MiB)")
        return Policy(SacPolicy.BUDGET, fraction)
    raise ConfigError(f"unknown --sac policy {value!r}; choose {POLICY_CHOICES}")
