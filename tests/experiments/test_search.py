"""The trainability search: exact boundary, logarithmic probe count, OOM vs error, determinism."""
from __future__ import annotations

import json
import math
import signal

import pytest

from autosp.experiments.search import (
    ERROR,
    FOUND,
    INTERRUPTED,
    NO_OOM_UP_TO_MAX,
    OK,
    OOM,
    OOM_AT_MIN,
    TIMEOUT,
    binding_peak,
    default_granularity,
    search_max_length,
)
from autosp.harness.config import ConfigError


class ThresholdOracle:
    """Lengths up to `limit` train, longer ones OOM; counts and remembers what it was asked."""

    def __init__(self, limit: int, broken: dict[int, str] | None = None) -> None:
        self.limit = limit
        self.broken = broken or {}
        self.asked: list[int] = []

    def __call__(self, seq_len: int) -> str:
        self.asked.append(seq_len)
        if seq_len in self.broken:
            return self.broken[seq_len]
        return OK if seq_len <= self.limit else OOM


@pytest.mark.parametrize("limit", [512, 513, 1024, 5000, 12_800, 99_999, 131_071])
def test_finds_exact_boundary_with_logarithmic_probes(limit: int) -> None:
    g, max_len = 256, 1 << 20
    oracle = ThresholdOracle(limit)
    out = search_max_length(oracle, granularity=g, min_len=g, max_len=max_len)
    assert out.status == FOUND
    assert out.max_seq_len == (limit // g) * g
    assert out.first_oom_seq_len == out.max_seq_len + g
    assert all(n % g == 0 for n in oracle.asked)
    assert len(set(oracle.asked)) == len(oracle.asked), "a length was probed twice"
    # doubling phase + bisection: about 2*log2(answer/g) probes, not answer/g
    assert len(oracle.asked) <= 2 * math.ceil(math.log2(limit / g + 1)) + 2
    assert [p for p, _ in out.probes] == oracle.asked


def test_probe_count_grows_logarithmically() -> None:
    counts = []
    for limit in (1 << 12, 1 << 16, 1 << 20):
        oracle = ThresholdOracle(limit + 100)
        search_max_length(oracle, granularity=128, min_len=128, max_len=1 << 24)
        counts.append(len(oracle.asked))
    # 16x longer answers cost a constant number of extra probes (2 per doubling step at most)
    assert counts[1] - counts[0] <= 8 and counts[2] - counts[1] <= 8
    assert counts[2] < 50


def test_start_len_above_limit_shrinks_then_bisects() -> None:
    oracle = ThresholdOracle(3000)
    out = search_max_length(oracle, granularity=256, min_len=256, max_len=1 << 16, start_len=32768)
    assert out.status == FOUND and out.max_seq_len == 2816 and out.first_oom_seq_len == 3072
    assert oracle.asked[:2] == [32768, 32768 - 256]  # the hint and its neighbour, then geometric shrink
    assert oracle.asked[2] < 16384 and len(oracle.asked) <= 12


def test_start_len_below_limit_skips_the_short_probes() -> None:
    oracle = ThresholdOracle(9000)
    out = search_max_length(oracle, granularity=512, min_len=512, max_len=1 << 16, start_len=8192)
    assert out.max_seq_len == 8704
    assert min(oracle.asked) == 8192


def test_no_oom_up_to_max_len() -> None:
    oracle = ThresholdOracle(10**9)
    out = search_max_length(oracle, granularity=512, min_len=512, max_len=5000)
    assert out.status == NO_OOM_UP_TO_MAX
    assert out.max_seq_len == 4608 and out.first_oom_seq_len is None
    assert oracle.asked[-1] == 4608  # clamps the last doubling to max_len


def test_oom_at_min_len() -> None:
    oracle = ThresholdOracle(100)
    out = search_max_length(oracle, granularity=512, min_len=1024, max_len=8192)
    assert out.status == OOM_AT_MIN
    assert out.max_seq_len is None and out.first_oom_seq_len == 1024
    assert oracle.asked == [1024]


@pytest.mark.parametrize("failure", [ERROR, TIMEOUT, INTERRUPTED])
def test_error_or_timeout_stops_and_is_never_taken_for_oom(failure: str) -> None:
    # the crash happens at 2048 while memory would allow 6000: an OOM-treating search would answer 1536
    oracle = ThresholdOracle(6000, broken={2048: failure})
    out = search_max_length(oracle, granularity=512, min_len=512, max_len=1 << 16)
    assert out.status == failure
    assert out.max_seq_len == 1024  # what was seen training before the failure, reported as such
    assert out.first_oom_seq_len is None
    assert oracle.asked[-1] == 2048, "the search must stop at the failing probe"


def test_unknown_probe_status_counts_as_error() -> None:
    out = search_max_length(lambda n: "segfault", granularity=256, min_len=256, max_len=4096)
    assert out.status == ERROR and out.max_seq_len is None


def test_deterministic() -> None:
    runs = [search_max_length(ThresholdOracle(7777), granularity=384, min_len=384, max_len=1 << 18) for _ in range(2)]
    assert runs[0] == runs[1]


def test_bad_range_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="granularity"):
        search_max_length(ThresholdOracle(1), granularity=1024, min_len=100, max_len=1000)
    with pytest.raises(ConfigError, match="granularity"):
        search_max_length(ThresholdOracle(1), granularity=0, min_len=100, max_len=1000)


def test_default_granularity_is_a_multiple_every_method_accepts() -> None:
    for p in (1, 2, 4, 8):
        g = default_granularity(p)
        assert g % p == 0 and g % (2 * p) == 0 and g % 128 == 0


class LinearMemoryOracle(ThresholdOracle):
    """Peak = fixed + per_token * S (like a real run), OOM above the budget; reports (status, peak)."""

    def __init__(self, fixed: int, per_token: int, budget: int, noise=None) -> None:
        super().__init__(limit=(budget - fixed) // per_token)
        self.fixed, self.per_token, self.noise = fixed, per_token, noise

    def __call__(self, seq_len: int):
        status = super().__call__(seq_len)
        peak = self.fixed + self.per_token * seq_len
        return status, (peak if self.noise is None else self.noise(seq_len))


@pytest.mark.parametrize("per_token", [700, 2_000, 17_000, 59_000])
def test_peaks_guide_the_search_to_a_few_probes(per_token: int) -> None:
    budget = 1 << 30
    oracle = LinearMemoryOracle(fixed=300 << 20, per_token=per_token, budget=budget)
    out = search_max_length(oracle, granularity=512, min_len=512, max_len=1 << 22, budget=budget)
    assert out.status == FOUND and out.max_seq_len == (oracle.limit // 512) * 512
    assert len(oracle.asked) <= 5, oracle.asked  # bisection alone needs 2*log2(answer/g) ~ 10-20
    assert len(set(oracle.asked)) == len(oracle.asked)


@pytest.mark.parametrize("per_token", [700, 17_000, 59_000])
def test_resident_bytes_let_the_first_probe_jump_near_the_limit(per_token: int) -> None:
    """One probe's peak and its step-start bytes give a line: jump, then the answer and one step above."""
    budget, fixed = 1 << 30, 300 << 20
    oracle = LinearMemoryOracle(fixed=fixed, per_token=per_token, budget=budget)
    # the resident bytes miss part of the fixed cost (optimizer temporaries): the jump must stay below the limit
    with_resident = lambda n: (*oracle(n), fixed - (40 << 20))  # noqa: E731
    out = search_max_length(with_resident, granularity=512, min_len=512, max_len=1 << 22, budget=budget)
    assert out.status == FOUND and out.max_seq_len == (oracle.limit // 512) * 512
    assert oracle.asked[1] <= oracle.limit and len(oracle.asked) <= 4, oracle.asked


@pytest.mark.parametrize("per_token", [700, 17_000, 59_000])
def test_a_start_far_above_the_limit_jumps_by_its_peak_instead_of_probing_its_neighbour(per_token: int) -> None:
    """A hint 4x too long (a memory floor's limit): its neighbour is as far off, so the line is followed at once."""
    budget, fixed = 1 << 30, 300 << 20
    oracle = LinearMemoryOracle(fixed=fixed, per_token=per_token, budget=budget)
    with_resident = lambda n: (*oracle(n), fixed - (40 << 20))  # noqa: E731
    start = (4 * oracle.limit // 512) * 512
    out = search_max_length(with_resident, granularity=512, min_len=512, max_len=1 << 24, budget=budget,
                            start_len=start)
    assert out.status == FOUND and out.max_seq_len == (oracle.limit // 512) * 512
    assert start - 512 not in oracle.asked and len(oracle.asked) <= 4, oracle.asked


def _curve_oracle(peak, budget: int, resident: int):
    asked: list[int] = []

    def probe(n: int):
        asked.append(n)
        return (OK if peak(n) <= budget else OOM), peak(n), resident
    return probe, asked


GIB = 1 << 30


@pytest.mark.parametrize("start_len, most", [(None, 7), (38912, 6), (622592, 4)])
def test_a_peak_flat_under_an_optimizer_step_then_steep_takes_a_few_probes(start_len, most) -> None:
    """A length-independent peak (the optimizer step: ds-autosp llama-3.1-8b on an a100, 75.29 GiB from 2K to 53K)
    hides the activations' line at short lengths; regula falsi through a flat ok side creeps up one step at a
    time (18 probes from the minimum before), so the flat side jumps and the out-of-memory side gives the line."""
    budget = 78 * GIB
    probe, asked = _curve_oracle(lambda n: max(int(0.99 * budget), 20 * GIB + 400_000 * n), budget, 15 * GIB)
    out = search_max_length(probe, granularity=2048, min_len=2048, max_len=1 << 22, budget=budget,
                            start_len=start_len)
    assert out.max_seq_len == 155648 and out.first_oom_seq_len == 157696
    assert len(asked) <= most, asked


@pytest.mark.parametrize("start_len", [None, 278528])
def test_a_peak_that_jumps_is_found_from_the_line_above_the_jump(start_len) -> None:
    """A peak with a step (a second buffer appearing past some length, seen: ring ZeRO-3 llama-2-13b between 16K
    and 18K) and a shallow line after it: the probes out of memory lie on that line."""
    budget = 78 * GIB
    probe, asked = _curve_oracle(lambda n: 30 * GIB + 600_000 * n if n < 17000 else 65 * GIB + 200_000 * n,
                                 budget, 20 * GIB)
    out = search_max_length(probe, granularity=2048, min_len=2048, max_len=1 << 22, budget=budget,
                            start_len=start_len)
    assert out.max_seq_len == 69632
    assert len(asked) <= 7, asked


def test_misleading_peaks_cannot_change_the_answer_or_blow_up_the_probe_count() -> None:
    import random

    rng = random.Random(0)
    for trial in range(50):
        limit = rng.randrange(512, 1 << 20)
        oracle = LinearMemoryOracle(fixed=0, per_token=1, budget=limit)
        oracle.noise = lambda n: rng.randrange(1, 1 << 30)  # peaks that mean nothing
        out = search_max_length(oracle, granularity=512, min_len=512, max_len=1 << 21, budget=limit)
        assert out.max_seq_len == (limit // 512) * 512, trial
        assert len(oracle.asked) <= 3 * (2 * math.ceil(math.log2(limit / 512 + 1)) + 2)


def test_an_out_of_memory_whose_peak_fits_is_bisected_not_crept_down_on() -> None:
    """Host memory bounds the length far below where the device's line meets its budget (8B on 8 x h200 simulated:
    out of memory from 8,134,656 tokens with the device at 101 of 148 GB). The device's line put every guess one
    granule under the shortest out-of-memory probe: 35 probes. An out-of-memory peak within the budget says another
    memory binds: bisection, about log2 of the bracket."""
    budget, granularity, limit = 148_369_645_240, 2048, 8_132_608
    asked: list[int] = []

    def probe(n: int):
        asked.append(n)
        return (OK if n <= limit else OOM), int(30_901_865_472 + 10_336 * (n - 1_345_536)), 20 * GIB

    out = search_max_length(probe, granularity=granularity, min_len=granularity, max_len=1 << 25,
                            start_len=1_345_536, budget=budget)
    assert out.max_seq_len == limit and out.first_oom_seq_len == limit + granularity
    bracket = (asked[1] - asked[0]) // granularity  # the start ok, the line's jump oom
    assert len(asked) <= 2 + math.ceil(math.log2(bracket)) + 2, asked


class FakeRunner:
    """Stands in for autosp.harness.runner.run: peak = per_token * S, OOM above the budget, an error at `error_at`."""

    def __init__(self, per_token: int, error_at: int | None = None) -> None:
        self.per_token, self.error_at = per_token, error_at
        self.configs: list = []

    def __call__(self, cfg):
        from autosp.harness.records import new_record

        self.configs.append(cfg)
        record = new_record(cfg, sp_size=cfg.world_size)
        if cfg.seq_len == self.error_at:
            record.update(status="error", error="rank 1: RuntimeError: boom")
        else:
            peak = self.per_token * cfg.seq_len
            record.update(status=OK if peak <= cfg.memory_budget else OOM, peak_mem_bytes=peak)
        return record


class HostBoundRunner(FakeRunner):
    """A run that offloads `host_per_token` bytes a token a rank, bounded by the config's --host-memory-budget (two
    ranks on the node), its device peak far inside the budget."""

    def __init__(self, per_token: int, host_per_token: int) -> None:
        super().__init__(per_token)
        self.host_per_token = host_per_token

    def __call__(self, cfg):
        record = super().__call__(cfg)
        host = 2 * self.host_per_token * cfg.seq_len
        record["extra"].update(node_host_bytes=host, host_budget_bytes=cfg.host_memory_budget)
        if host > cfg.host_memory_budget:
            record["status"] = OOM
            record["extra"]["oom_in"] = "host"  # as `autosp.harness.runner` says it
        return record


def test_a_probe_where_host_memory_is_fuller_gives_the_search_no_device_intercept(monkeypatch, tmp_path) -> None:
    """The bytes resident at the step's start are the device's line at length 0: a probe whose host memory is the
    fuller hands the search its host peak without them (a line from the device's intercept to a host peak guessed
    a granule above the last ok probe: 1B on 8 x mi250, simulated)."""
    from autosp.experiments import search
    from autosp.harness.records import new_record

    resident, host_budget = 20 << 20, 6_553_600

    def runner(cfg):  # the device fuller at short lengths, host memory from about 10K tokens on
        record = new_record(cfg, sp_size=cfg.world_size)
        device, host = resident + 100 * cfg.seq_len, host_budget // 5 + 128 * cfg.seq_len
        record.update(status=OK if host <= host_budget else OOM, peak_mem_bytes=device)
        record["extra"].update(node_host_bytes=host, host_budget_bytes=host_budget,
                               memory={"resident_at_step_start_bytes": resident})
        return record

    seen: list[tuple[int, tuple]] = []
    real = search.search_max_length
    monkeypatch.setattr(search, "search_max_length", lambda probe, **kw: real(
        lambda n: seen.append((n, probe(n))) or seen[-1][1], **kw))
    row = search.run_search(_cfg(host_memory_budget=host_budget), out=str(tmp_path / "s.jsonl"), granularity=512,
                            max_len=1 << 20, start_len=512, run=runner)
    assert row["max_seq_len"] == 40_960
    devices = {n: resident + 100 * n for n, _ in seen}
    assert any(peak == devices[n] for n, (_, peak, _) in seen) and any(peak > devices[n] for n, (_, peak, _) in seen)
    for n, (_, peak, given) in seen:
        assert given == (resident if peak == devices[n] else None), n


def test_the_peak_a_search_follows_is_the_fuller_memory_in_the_devices_scale() -> None:
    record = {"peak_mem_bytes": 30, "extra": {"node_host_bytes": 600, "host_budget_bytes": 1000}}
    assert binding_peak(record, 100) == 60  # host 60% full: 60 of the device's 100
    assert binding_peak({**record, "peak_mem_bytes": 70}, 100) == 70  # the device fuller
    over = {"peak_mem_bytes": 30, "extra": {"node_host_bytes": 1001, "host_budget_bytes": 1000}}
    assert binding_peak(over, 100) == 101  # over the host budget: over the device's too (rounded up)
    assert binding_peak({"peak_mem_bytes": 30, "extra": {}}, 100) == 30  # no host bound
    assert binding_peak({"peak_mem_bytes": None, "extra": {}}, 100) is None and binding_peak(record, None) == 30


def test_run_search_where_host_memory_binds_follows_the_host_line(tmp_path) -> None:
    """Host memory holds 40,960 tokens, the device's line crosses its budget far above: the probes follow the host
    bytes (a few), where the device's peaks put each guess a granule under the last out-of-memory probe."""
    from autosp.experiments.search import run_search

    runner = HostBoundRunner(per_token=100, host_per_token=64)
    cfg = _cfg(host_memory_budget=2 * 64 * 40_960)
    row = run_search(cfg, out=str(tmp_path / "s.jsonl"), granularity=512, max_len=1 << 20, start_len=512, run=runner)
    assert row["status"] == FOUND and row["max_seq_len"] == 40_960 and row["first_oom_seq_len"] == 41_472
    assert all(p["peak_mem_bytes"] <= cfg.memory_budget // 10 for p in row["probes"])  # the device never binds
    assert row["num_probes"] <= 5, row["probes"]
    assert row["extra"]["binds"] == "host"  # what ran out one granule above the answer


def _cfg(**kw):
    from autosp.harness.config import RunConfig

    return RunConfig(method="ulysses", model="tiny", seq_len=1, world_size=2, memory_budget=64 << 20, **kw)


def test_run_search_records_every_probe_and_one_result_row(tmp_path) -> None:
    from autosp.experiments.search import run_search
    from autosp.harness.records import load_records

    out = tmp_path / "trainability.jsonl"
    runner = FakeRunner(per_token=(64 << 20) // 3000)
    row = run_search(_cfg(), out=str(out), run=runner)
    df = load_records(out)
    probes, results = df[df["kind"].isna()], df[df["kind"] == "search"]
    assert len(probes) == len(runner.configs) == row["num_probes"] and len(results) == 1
    assert set(probes["search_id"]) == {row["search_id"]}
    assert (row["status"], row["max_seq_len"], row["first_oom_seq_len"]) == (FOUND, 2560, 3072)
    assert row["granularity"] == 512 and row["peak_mem_bytes"] == runner.per_token * 2560
    assert row["extra"]["binds"] == "device"  # the probe one granule above names no other memory
    assert all(c.method == "ulysses" and c.world_size == 2 and c.memory_budget == 64 << 20 for c in runner.configs)
    # the floor model bounds what any method could do in this budget
    assert row["floor_limit_seq_len"] > 0 and row["achieved_over_limit"] == 2560 / row["floor_limit_seq_len"]
    assert results.iloc[0]["floor.method"] == "ulysses"


def test_run_search_reports_an_error_probe_as_error(tmp_path) -> None:
    from autosp.experiments.search import run_search

    # the second probe (a plain doubling: one peak cannot guide yet) fails although memory would allow more
    row = run_search(_cfg(), out=str(tmp_path / "t.jsonl"), run=FakeRunner(per_token=1000, error_at=1024))
    assert row["status"] == ERROR and "boom" in row["error"]
    assert row["max_seq_len"] == 512 and row["first_oom_seq_len"] is None and row["num_probes"] == 2


def test_cpu_search_without_budget_is_a_config_error(tmp_path) -> None:
    from autosp.experiments.search import run_search

    with pytest.raises(ConfigError, match="--memory-budget"):
        run_search(_cfg().replace(memory_budget=None), out=str(tmp_path / "t.jsonl"), run=FakeRunner(per_token=1))


@pytest.mark.slow
def test_real_tiny_search_is_deterministic(tmp_path) -> None:
    """Two real searches (ranks launched, AdamW steps, CPU allocation peaks) give identical probes and answer."""
    from autosp.cli import main
    from autosp.harness.records import load_records

    runs = []
    for i in range(2):
        out = tmp_path / f"search{i}.jsonl"
        assert main(["search", "--method", "single", "--model", "tiny", "--world-size", "1", "--memory-budget", "28MiB",
                     "--granularity", "1024", "--min-len", "1024", "--max-len", "4096", "--out", str(out)]) == 0
        runs.append(load_records(out))
    probes = [df.loc[df["kind"].isna(), ["seq_len", "status", "peak_mem_bytes"]].to_dict("records") for df in runs]
    assert probes[0] == probes[1]
    result = runs[0][runs[0]["kind"] == "search"].iloc[0]
    assert (result["status"], result["max_seq_len"], result["first_oom_seq_len"]) == (FOUND, 1024, 2048)
    # the analytic floor is a lower bound of what was measured
    floor_bytes = result["floor.static_bytes"] + result["floor.activation_bytes_per_token"] * 1024
    assert floor_bytes <= result["peak_mem_bytes"]


def test_resume_starts_from_the_previous_answer_of_the_same_search(tmp_path) -> None:
    from autosp.experiments.search import run_search

    out = str(tmp_path / "t.jsonl")
    first = run_search(_cfg(), out=out, run=FakeRunner(per_token=(64 << 20) // 3000))
    again = FakeRunner(per_token=(64 << 20) // 3000)
    second = run_search(_cfg(), out=out, resume=True, run=again)
    assert second["max_seq_len"] == first["max_seq_len"] == 2560
    assert [c.seq_len for c in again.configs] == [2560, 3072]  # confirmed in two probes
    other = FakeRunner(per_token=(64 << 20) // 3000)
    run_search(_cfg(dtype="bfloat16"), out=out, resume=True, run=other)  # a different search: from scratch
    assert other.configs[0].seq_len == 512


SEARCH = ["search", "--method", "ulysses", "--model", "tiny", "--world-size", "2", "--memory-budget", "64MiB"]


@pytest.mark.parametrize("flags,message", [
    (["--granularity", "3"], "--granularity 3 makes probe lengths the method refuses"),
    (["--granularity", "0"], "--granularity must be positive, got 0"),
    (["--granularity", "512", "--min-len", "-1"], "--min-len must be positive"),
])
def test_bad_search_range_is_one_line_naming_the_flag(tmp_path, capsys, flags: list[str], message: str) -> None:
    from autosp.cli import main

    assert main([*SEARCH, *flags, "--out", str(tmp_path / "t.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "t.jsonl").exists()


def test_a_method_that_refuses_the_model_says_so_not_the_granularity(tmp_path, capsys) -> None:
    from autosp.cli import main

    args = ["search", "--method", "ulysses", "--model", "hf:tiny", "--world-size", "2", "--memory-budget", "64MiB"]
    assert main([*args, "--out", str(tmp_path / "t.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ulysses" in err and "--granularity" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_autosp_search_ends_every_rank_and_records_interrupted(tmp_path, sig: signal.Signals) -> None:
    from autosp.harness.supervisor import INTERRUPTED_EXIT_CODE
    from tests.harness.processes import interrupt_once_ranks_run, marked_processes, new_mark, start_cli

    mark = new_mark()
    out_file = tmp_path / "t.jsonl"
    proc = start_cli([*SEARCH, "--max-len", "4096", "--out", str(out_file)], mark, tmp_path)
    _, err, seconds = interrupt_once_ranks_run(proc, mark, sig)
    assert proc.returncode == INTERRUPTED_EXIT_CODE, err
    assert seconds < 15, seconds
    assert marked_processes(mark) == []
    probe, row = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert probe["status"] == row["status"] == INTERRUPTED and row["kind"] == "search"
    assert f"interrupted by {sig.name}" in row["error"]


# --- the guided search: a prediction first, bracketing only where a probe disagrees ---------------------------

def _plain_and_guided(oracle_factory, predicted: int, g: int = 512, max_len: int = 1 << 20, budget=None):
    from autosp.experiments.search import guided_search_max_length

    plain_oracle, guided_oracle = oracle_factory(), oracle_factory()
    plain = search_max_length(plain_oracle, granularity=g, min_len=g, max_len=max_len, budget=budget)
    guided = guided_search_max_length(guided_oracle, predicted=predicted, granularity=g, min_len=g, max_len=max_len,
                                      budget=budget)
    return plain, guided, guided_oracle


@pytest.mark.parametrize("limit", [512, 5000, 18_432, 99_999])
def test_a_right_prediction_costs_exactly_two_measured_probes(limit: int) -> None:
    answer = (limit // 512) * 512
    plain, guided, oracle = _plain_and_guided(lambda: ThresholdOracle(limit), predicted=answer)
    assert (guided.status, guided.max_seq_len, guided.first_oom_seq_len) == \
        (plain.status, plain.max_seq_len, plain.first_oom_seq_len) == (FOUND, answer, answer + 512)
    assert oracle.asked == [answer, answer + 512]
    assert guided.disagreements == [] and guided.predicted_max_seq_len == answer


@pytest.mark.parametrize("off_by", [0.7, 1.3])
@pytest.mark.parametrize("with_peaks", [False, True])
def test_a_prediction_30_percent_off_still_returns_the_measured_answer(off_by: float, with_peaks: bool) -> None:
    budget, limit = 1 << 30, 18_432
    factory = (lambda: LinearMemoryOracle(fixed=0, per_token=budget // limit, budget=budget)) if with_peaks \
        else (lambda: ThresholdOracle(limit))
    predicted = int(off_by * limit) // 512 * 512
    plain, guided, oracle = _plain_and_guided(factory, predicted=predicted, budget=budget if with_peaks else None)
    assert (guided.status, guided.max_seq_len, guided.first_oom_seq_len) == \
        (plain.status, plain.max_seq_len, plain.first_oom_seq_len) == (FOUND, limit, limit + 512)
    assert len(set(oracle.asked)) == len(oracle.asked), "a length was measured twice"
    assert [n for n, _ in guided.probes] == oracle.asked
    # the first probe that contradicted the prediction is on record: too low a prediction is found one step above
    # it (predicted oom, measured ok), too high at the prediction itself (predicted ok, measured oom)
    miss = {"seq_len": predicted + 512, "predicted": OOM, "measured": OK} if off_by < 1 \
        else {"seq_len": predicted, "predicted": OK, "measured": OOM}
    assert guided.disagreements == [miss]


def test_a_prediction_at_the_ends_of_the_range_needs_one_probe() -> None:
    from autosp.experiments.search import guided_search_max_length

    oracle = ThresholdOracle(10**9)
    out = guided_search_max_length(oracle, predicted=1 << 20, granularity=512, min_len=512, max_len=4096)
    assert (out.status, out.max_seq_len, oracle.asked) == (NO_OOM_UP_TO_MAX, 4096, [4096])
    oracle = ThresholdOracle(100)
    out = guided_search_max_length(oracle, predicted=0, granularity=512, min_len=1024, max_len=8192)
    assert (out.status, out.first_oom_seq_len, oracle.asked) == (OOM_AT_MIN, 1024, [1024])


def test_a_failed_probe_stops_a_guided_search_with_what_was_measured() -> None:
    from autosp.experiments.search import guided_search_max_length

    oracle = ThresholdOracle(6000, broken={6144: ERROR})
    out = guided_search_max_length(oracle, predicted=5632, granularity=512, min_len=512, max_len=1 << 16)
    assert (out.status, out.max_seq_len, out.first_oom_seq_len) == (ERROR, 5632, None)
    assert oracle.asked == [5632, 6144] and out.disagreements == []


def _stub_prediction(value: int):
    def predict(cfg, *, granularity: int, min_len: int, max_len: int) -> int:
        predict.calls.append((cfg.method, granularity, min_len, max_len))
        return value
    predict.calls = []
    predict.guide_name = "stub"
    return predict


def test_run_search_guided_by_a_right_prediction_measures_two_probes(tmp_path) -> None:
    from autosp.experiments.search import run_search

    plain = run_search(_cfg(), out=str(tmp_path / "plain.jsonl"), run=FakeRunner(per_token=(64 << 20) // 3000))
    runner, predict = FakeRunner(per_token=(64 << 20) // 3000), _stub_prediction(2560)
    row = run_search(_cfg(), out=str(tmp_path / "guided.jsonl"), run=runner, predict=predict)
    assert predict.calls == [("ulysses", 512, 512, 1 << 20)]
    assert [c.seq_len for c in runner.configs] == [2560, 3072] and row["num_probes"] == 2 < plain["num_probes"]
    assert (row["max_seq_len"], row["first_oom_seq_len"]) == (plain["max_seq_len"], plain["first_oom_seq_len"])
    assert (row["guide"], row["predicted_max_seq_len"], row["guide_disagreements"]) == ("stub", 2560, [])
    assert row["predict_wall_s"] >= 0 and plain["guide"] == "off" and plain["predicted_max_seq_len"] is None


def test_run_search_records_a_prediction_30_percent_off_and_returns_the_measured_answer(tmp_path) -> None:
    from autosp.experiments.search import run_search
    from autosp.harness.records import load_records

    out = tmp_path / "t.jsonl"
    runner = FakeRunner(per_token=(64 << 20) // 15_000)  # measured: 14,848 trains, 15,360 does not
    row = run_search(_cfg(), out=str(out), run=runner, predict=_stub_prediction(int(1.3 * 14_848) // 512 * 512))
    assert (row["status"], row["max_seq_len"], row["first_oom_seq_len"]) == (FOUND, 14_848, 15_360)
    assert row["predicted_max_seq_len"] == 18_944
    assert row["guide_disagreements"] == [{"seq_len": 18_944, "predicted": OK, "measured": OOM}]
    saved = load_records(out)
    assert saved.loc[saved["kind"] == "search", "predicted_max_seq_len"].tolist() == [18_944]
    assert len(saved[saved["kind"].isna()]) == row["num_probes"] == len({c.seq_len for c in runner.configs})


def test_run_search_without_a_prediction_runs_the_plain_search_and_says_why(tmp_path) -> None:
    from autosp.experiments.search import run_search

    def cannot(cfg, **_):
        raise ConfigError("--method ulysses cannot be simulated: a reason")

    runner = FakeRunner(per_token=(64 << 20) // 3000)
    row = run_search(_cfg(), out=str(tmp_path / "t.jsonl"), run=runner, predict=cannot)
    assert row["max_seq_len"] == 2560 and row["predicted_max_seq_len"] is None
    assert row["guide"] == "off: no prediction (--method ulysses cannot be simulated: a reason)"
    hinted = run_search(_cfg(), out=str(tmp_path / "h.jsonl"), run=FakeRunner(per_token=(64 << 20) // 3000),
                        start_len=2560, predict=_stub_prediction(512))  # a given start length wins
    assert hinted["guide"] == "off: a start length was given" and hinted["num_probes"] == 2


def test_guided_search_is_the_cli_default_and_can_be_turned_off(monkeypatch, tmp_path) -> None:
    from autosp.cli import main
    from autosp.experiments import search

    seen = []
    monkeypatch.setattr(search, "run_search", lambda cfg, **kw: seen.append(kw["predict"]) or {
        "status": FOUND, "max_seq_len": 512, "first_oom_seq_len": 1024, "floor_limit_seq_len": None,
        "achieved_over_limit": None, "num_probes": 2, "wall_s": 0.0, "predicted_max_seq_len": 512,
        "guide_disagreements": [], "extra": {"binds": "device"}})
    for extra in ([], ["--guide", "off"]):
        assert main([*SEARCH, *extra, "--out", str(tmp_path / "t.jsonl")]) == 0
    from autosp.experiments.guided import simulated

    assert seen == [simulated, None]


@pytest.mark.parametrize("off_by", [0.7, 0.77, 1.3])
def test_after_a_wrong_prediction_the_peaks_measured_lead_to_the_answer_in_few_probes(off_by: float) -> None:
    """The two probes of a wrong prediction give the line through their peaks: two more probes at most (the answer
    and one step above it), not a bracketing from scratch (ds-autosp hf:tiny: predicted 8,704, measured 11,264)."""
    from autosp.experiments.search import guided_search_max_length

    budget, g = 48 << 20, 512
    oracle = LinearMemoryOracle(fixed=3 << 20, per_token=4200, budget=budget)
    answer = (oracle.limit // g) * g
    out = guided_search_max_length(oracle, predicted=int(off_by * answer) // g * g, granularity=g, min_len=g,
                                   max_len=1 << 20, budget=budget)
    assert (out.max_seq_len, out.first_oom_seq_len) == (answer, answer + g)
    assert len(oracle.asked) <= 4, oracle.asked
