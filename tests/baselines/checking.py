"""`autosp check` of a method on tiny presets: the method on P gloo ranks vs single-process training.

A module's checks share launches: it maps each test that checks to its configuration (`CONFIGS`: the test's name ->
a function of its parameters returning the RunConfig), and its tests ask the suite's `checks` fixture
(tests/conftest.py) for their reports. The first test that asks runs every selected test's check of the module
through `check_many` (one launch per world size, every reference in one process); each test then asserts on its own
configuration's report."""
from __future__ import annotations

import json

import pytest

from autosp.harness.check import DEFAULT_STEPS, CheckReport, check, check_many
from autosp.harness.config import DataConfig, RunConfig

DATA_OPTIONS = ("ignore_fraction", "packed_documents", "pad_fraction", "pad_side")


def check_config(method: str, world_size: int, model: str = "tiny", seq_len: int = 64, timeout_s: float = 300,
                 **options) -> RunConfig:
    """A check's configuration: the data options (DATA_OPTIONS) go to its DataConfig, the rest to the RunConfig."""
    data = DataConfig(**{k: options.pop(k) for k in DATA_OPTIONS if k in options})
    return RunConfig(method=method, model=model, seq_len=seq_len, world_size=world_size, data=data,
                     timeout_s=timeout_s, **options)


def assert_check_passes(method: str, world_size: int, model: str = "tiny", seq_len: int = 64, **options) -> CheckReport:
    """One check in a launch of its own (for a module whose other cases run elsewhere)."""
    report = check(check_config(method, world_size, model, seq_len, **options))
    assert report.passed, report.format()
    return report


class Checks:
    """The checks of a module's selected tests, run together the first time one is asked for (`check_many`);
    each test then asks for its own configuration's report."""

    def __init__(self, cfgs: list[RunConfig], steps: int = DEFAULT_STEPS) -> None:
        self.cfgs, self.steps, self.reports = cfgs, steps, None

    def report(self, cfg: RunConfig) -> CheckReport:
        if self.reports is None:
            self.reports = dict(zip((_key(c) for c in self.cfgs), check_many(self.cfgs, steps=self.steps),
                                    strict=True))
        return self.reports[_key(cfg)]

    def passed(self, cfg: RunConfig) -> CheckReport:
        report = self.report(cfg)
        assert report.passed, report.format()
        return report


def module_checks(request: pytest.FixtureRequest) -> Checks:
    """The `Checks` of every selected test of the requesting module named in its `CONFIGS` (by its parameters;
    `CHECK_STEPS` AdamW steps where the module sets it)."""
    module = request.module
    return Checks([module.CONFIGS[item.originalname](**_parameters(item)) for item in request.session.items
                   if item.module is module and item.originalname in module.CONFIGS],
                  getattr(module, "CHECK_STEPS", DEFAULT_STEPS))


def _parameters(item: pytest.Item) -> dict:
    callspec = getattr(item, "callspec", None)
    return {} if callspec is None else dict(callspec.params)


def _key(cfg: RunConfig) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True, default=str)
