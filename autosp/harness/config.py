"""Plain data describing one training run: what every layer of the harness passes around.

Kept free of torch.distributed state so it can be hashed into `config_hash`, written into records
and rebuilt in a worker process from its dict.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from autosp.errors import ConfigError
from autosp.models.data import DataConfig

__all__ = ["ConfigError", "DataConfig", "METHOD_OPTIONS", "UNREAD_OPTIONS", "RunConfig"]

#: RunConfig fields only some methods read; each method declares its own (`strategy.Strategy.options`) and
#: neither receives nor records the others (they stay at their defaults: `Strategy.own_config`)
METHOD_OPTIONS = ("sac", "compile_backend", "zero", "tiling", "ulysses_size", "offload", "ac", "attention_chunks")
#: what a method that does not read an option records for it (`Strategy.own_config`): autosp's options as they were
#: before its defaults became the planner's, so that every other method's records keep their `config_hash`
UNREAD_OPTIONS = {"sac": "sac", "tiling": "off", "offload": "off"}
#: `--ac`: the baselines' per-layer activation checkpointing (`baselines.checkpointing`)
ACTIVATION_CHECKPOINTING = ("off", "layer")


@dataclass(frozen=True)
class RunConfig:
    """One measured run or correctness check of one method."""

    method: str
    model: str
    seq_len: int
    batch_size: int = 1  # sequences per data-parallel replica
    world_size: int = 1
    sp_size: int | None = None  # None: the method's default (world_size for SP methods, 1 for DP methods)
    dtype: str = "float32"
    device: str = "cpu"  # cpu | cuda (ROCm builds of torch report cuda too)
    seed: int = 0
    lr: float = 1e-3
    steps: int = 3  # timed steps after the measured one; 0: measure the peak only (a search probe)
    warmup: int = 1
    sac: str = "auto"  # autosp only: auto (the planner) | off | sac | full | budget=<fraction> | budget=<bytes>
    compile_backend: str = "inductor"  # inductor | aot_eager | eager (for methods that compile)
    memory_budget: int | None = None  # bytes; on CPU a peak above it ends the run as `oom`
    timeout_s: float = 600.0
    data: DataConfig = field(default_factory=DataConfig)
    zero: int | None = None  # ZeRO stage 0-3 of the model state; None: the method's own (records hold the stage run)
    #: autosp only: plan | off | auto | loss,mlp,norm,recurrence, optionally :<tokens per tile> (tiling)
    tiling: str = "plan"
    ulysses_size: int | None = None  # autosp only: Ulysses group size of the hybrid Ulysses x Ring (None: automatic)
    offload: str = "auto"  # autosp only: `autosp.compiler.memory.OffloadPlan`'s text: auto (the --sac auto planner
    # decides the activations, optimizer state and parameters) | off | activations | auto, optionally with an
    # `optimizer` item (master weights + AdamW moments in host memory) and a `params` item (the parameters too)
    ac: str = "off"  # ulysses, ring, zero3, fsdp: off | layer (per-layer activation checkpointing)
    host_memory_budget: int | None = None  # bytes of host memory per node; more offloaded there ends the run as `oom`
    attention_chunks: int = 1  # autosp only: each attention's all-to-alls and kernel in chunks of heads (1: none)

    def __post_init__(self) -> None:
        """Every number is checked here, once, whoever builds the config (flags, a record, a search probe)."""
        for name in ("seq_len", "batch_size", "world_size"):
            _check_integer(name, getattr(self, name), low=1)
        for name in ("steps", "warmup"):
            _check_integer(name, getattr(self, name), low=0)
        _check_integer("seed", self.seed, low=0, below=2**32)
        if self.sp_size is not None:
            _check_integer("sp_size", self.sp_size, low=1)
        if self.memory_budget is not None:
            _check_integer("memory_budget", self.memory_budget, low=1)
        _check_number("lr", self.lr, low=0.0, low_open=True)
        _check_number("timeout_s", self.timeout_s, low=0.0, low_open=True)
        _check_number("data_ignore_fraction", self.data.ignore_fraction, low=0.0, below=1.0)
        _check_number("pad_fraction", self.data.pad_fraction, low=0.0, below=1.0)
        _check_integer("packed_documents", self.data.packed_documents, low=1)
        if self.ulysses_size is not None:
            _check_integer("ulysses_size", self.ulysses_size, low=1)
        if self.host_memory_budget is not None:
            _check_integer("host_memory_budget", self.host_memory_budget, low=1)
        _check_integer("attention_chunks", self.attention_chunks, low=1)
        if self.ac not in ACTIVATION_CHECKPOINTING:
            raise ConfigError(f"--ac must be one of {', '.join(ACTIVATION_CHECKPOINTING)}, got {self.ac!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        d = dict(d)
        d["data"] = DataConfig(**d.get("data", {}))
        return cls(**d)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def config_hash(self) -> str:
        """Stable hash of everything that defines the experiment (not how long it is timed)."""
        d = self.to_dict()
        for timing_only in ("steps", "warmup", "timeout_s"):
            d.pop(timing_only)
        for name, default in _HASHED_ONLY_WHEN_SET.items():  # older records (and their searches) keep their hash
            if d[name] == default:
                d.pop(name)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


#: fields added after records existed, with their defaults: hashed only when set
_HASHED_ONLY_WHEN_SET = {"ac": "off", "host_memory_budget": None, "attention_chunks": 1}

#: field -> the flag a user typed, where the two differ
_FLAGS = {"timeout_s": "--timeout"}


def flag_name(field_name: str) -> str:
    """The command-line flag of a RunConfig/DataConfig field, for messages."""
    return _FLAGS.get(field_name, "--" + field_name.replace("_", "-"))


def _check_integer(name: str, value: object, *, low: int, below: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (below is not None and value >= below):
        bound = {0: "non-negative", 1: "positive"}.get(low, f">= {low}")
        limit = f" below {below}" if below is not None else ""
        raise ConfigError(f"{flag_name(name)} must be {bound} (an integer{limit}), got {value!r}")


def _check_number(name: str, value: object, *, low: float, low_open: bool = False, below: float | None = None) -> None:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if low_open else value >= low) and (below is None or value < below))
    if not ok:
        if below is not None:
            bound = f"in [{low:g}, {below:g})"
        else:
            bound = "positive" if low_open and low == 0 else f">= {low:g}"
        raise ConfigError(f"{flag_name(name)} must be {bound} (a finite number), got {value!r}")
