"""Suite-wide fixtures."""
from __future__ import annotations

import resource
import time

import pytest
import torch
from hypothesis import HealthCheck, settings

from autosp.harness.launch import COMPILER_PRELOAD, WARM_RANK_PRELOAD
from autosp.harness.supervisor import warm_rank_cpu_seconds, warm_ranks
from tests.baselines.checking import module_checks

# --- Hypothesis profiles (tests/compiler/test_properties.py): `ci` by default, `--hypothesis-profile=nightly` ----
# ci: a small fixed set (derandomized: every run draws the same examples); nightly: many more, a new seed each run.
# A case costs a trace on P ranks, so no deadline; the examples are drawn without the database's replay in ci.
_PROFILE = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=4, derandomize=True, database=None, **_PROFILE)
settings.register_profile("nightly", max_examples=200, **_PROFILE)
settings.load_profile("ci")  # the plugin loads --hypothesis-profile's after this


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: Dynamo's per-code-object cache would otherwise fill up across tests
    (the same model forward compiled with many backends) and silently fall back to eager at its recompile limit."""
    torch._dynamo.reset()
    yield


@pytest.fixture(autouse=True, scope="session")
def warm_cpu_ranks():
    """CPU ranks forked from one server that imported torch, Dynamo, the compiler and the runner once
    (`supervisor.warm_ranks`): a short check's ranks otherwise spend most of their CPU importing. Tests of how ranks
    start and end use `cold_ranks`."""
    with warm_ranks(WARM_RANK_PRELOAD + COMPILER_PRELOAD):
        yield


@pytest.fixture(scope="module")
def checks(request):
    """The module's checks through its `CONFIGS`, sharing launches (tests/baselines/checking.py, `module_checks`)."""
    return module_checks(request)


@pytest.fixture
def cold_ranks():
    """Every rank a fresh interpreter, as outside the suite (tests that inspect rank processes or their start)."""
    with warm_ranks(None):
        yield


# --- options: the long profile, CPU-seconds per test (what a test costs on a shared machine) --------------------

def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="also run the long profile (tests marked `long`: the costliest variants of checks whose "
                          "cheaper variants run by default; docs/testing.md lists them)")
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="list the N tests that took the most CPU-seconds (this process and its reaped children)")
    parser.addoption("--cpu-durations-file", default=None, metavar="CSV",
                     help="append test,cpu_s,wall_s for every test to this file as it finishes")


def _cpu_seconds() -> float:
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + warm_rank_cpu_seconds()


_CPU_COSTS: dict[str, tuple[float, float]] = {}
_STARTED: dict[str, tuple[float, float]] = {}
_CSV: list[str] = []  # --cpu-durations-file, where this process writes it (not on an xdist worker)


def _is_worker(config) -> bool:
    """An xdist worker (`-n 2`): its reports and its counts go to the controller, which prints the summary."""
    return hasattr(config, "workerinput")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _STARTED[item.nodeid] = (_cpu_seconds(), time.perf_counter())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The test's cost (setup to teardown, this process and its reaped children) rides on its teardown report, so
    it reaches the controller of an xdist run as it reaches the terminal of a plain one."""
    outcome = yield
    if call.when == "teardown" and item.nodeid in _STARTED:
        cpu, wall = _STARTED.pop(item.nodeid)
        outcome.get_result().user_properties.append(
            ("cost", (_cpu_seconds() - cpu, time.perf_counter() - wall)))


def pytest_runtest_logreport(report):
    if report.when != "teardown":
        return
    cost = dict(report.user_properties).get("cost")
    if cost is None:
        return
    _CPU_COSTS[report.nodeid] = cost
    for path in _CSV:
        with open(path, "a") as f:
            f.write(f"{report.nodeid},{cost[0]:.1f},{cost[1]:.1f}\n")


def pytest_configure(config):
    path = config.getoption("--cpu-durations-file")
    if path and not _is_worker(config):
        _CSV.append(path)


def pytest_sessionfinish(session):
    if _is_worker(session.config):  # every worker collects the whole selection: each counts the same long tests
        session.config.workeroutput["long_deselected"] = getattr(session.config, "_autosp_long_deselected", 0)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller collects nothing itself: the long profile's count comes from its workers."""
    count = getattr(node, "workeroutput", {}).get("long_deselected", 0)
    node.config._autosp_long_deselected = max(count, getattr(node.config, "_autosp_long_deselected", 0))


def pytest_terminal_summary(terminalreporter, config):
    deselected = getattr(config, "_autosp_long_deselected", 0)
    if deselected:
        terminalreporter.write_line(f"long profile: {deselected} tests not run (pytest --long runs them too)")
    n = config.getoption("--cpu-durations")
    if not n:
        return
    terminalreporter.section(f"{n} costliest tests in CPU-seconds (with their children)")
    for nodeid, (cpu, wall) in sorted(_CPU_COSTS.items(), key=lambda kv: -kv[1][0])[:n]:
        terminalreporter.write_line(f"{cpu:8.1f} CPU-s {wall:8.1f} s  {nodeid}")
    terminalreporter.write_line(f"{sum(c for c, _ in _CPU_COSTS.values()):8.1f} CPU-s in all")


# --- the long profile: deselected by default, named in the summary so nothing is dropped silently ------------------

def pytest_collection_modifyitems(config, items):
    if config.getoption("--long"):
        return
    long, kept = [], []
    for item in items:
        (long if item.get_closest_marker("long") else kept).append(item)
    if long:
        config.hook.pytest_deselected(items=long)
        items[:] = kept
        config._autosp_long_deselected = len(long)
