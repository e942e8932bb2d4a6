"""`autosp check` of a baseline on tiny presets: method on P gloo ranks vs single-process training."""
from __future__ import annotations

from autosp.harness.check import CheckReport, check
from autosp.harness.config import DataConfig, RunConfig

DATA_OPTIONS = ("ignore_fraction", "packed_documents", "pad_fraction")


def assert_check_passes(method: str, world_size: int, model: str = "tiny", seq_len: int = 64, **options) -> CheckReport:
    data = DataConfig(**{k: options.pop(k) for k in DATA_OPTIONS if k in options})
    cfg = RunConfig(method=method, model=model, seq_len=seq_len, world_size=world_size, data=data, timeout_s=300,
                    **options)
    report = check(cfg)
    assert report.passed, report.format()
    return report
