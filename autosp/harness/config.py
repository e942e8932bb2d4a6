"""Plain data describing one training run: what every layer of the harness passes around.

Kept free of torch.distributed state so it can be hashed into `config_hash`, written into records
and rebuilt in a worker process from its dict.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from autosp.errors import ConfigError

__all__ = ["ConfigError", "DataConfig", "RunConfig"]


@dataclass(frozen=True)
class DataConfig:
    """Synthetic token data (no dataset can be downloaded): seeded, reproducible on every rank."""

    ignore_fraction: float = 0.0  # fraction of label positions set to -100, in uneven runs
    packed_documents: int = 1  # >1: each row holds this many documents, position_ids restart per document
    pad_fraction: float = 0.0  # fraction of each row that is right padding (attention_mask 0, labels -100)


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
    steps: int = 3
    warmup: int = 1
    sac: str = "sac"  # autosp only: off | sac | full | budget=<fraction>
    compile_backend: str = "inductor"  # inductor | aot_eager | eager (for methods that compile)
    memory_budget: int | None = None  # bytes; on CPU a peak above it ends the run as `oom`
    timeout_s: float = 600.0
    data: DataConfig = field(default_factory=DataConfig)
    ulysses_size: int | None = None  # autosp only: Ulysses group size of the hybrid Ulysses x Ring (None: automatic)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        d = dict(d)
        d["data"] = DataConfig(**d.get("data", {}))
        return cls(**d)

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def config_hash(self) -> str:
        """Stable hash of everything that defines the experiment (not how long it is timed)."""
        d = self.to_dict()
        for timing_only in ("steps", "warmup", "timeout_s"):
            d.pop(timing_only)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
