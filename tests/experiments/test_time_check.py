"""`autosp calibrate` (the cpu row of the time model's rates) and `autosp time-check` (predicted vs measured steps)."""
from __future__ import annotations

import csv
import math

import pytest
import torch

from autosp.experiments.calibrate import CPU_HEAD_DIM, calibrate
from autosp.experiments.time_check import cell_configs, format_rows, time_check
from autosp.timing.rates import MEASURED_COLLECTIVES, parse_collectives, write_cpu_rates


def test_calibration_measures_every_rate_of_the_cpu_row_from_two_ranks_at_once(tmp_path):
    row = calibrate(2, repeats=1)
    by_keys = dict(pair.split(":") for pair in row.pop("attention_by_keys").split())
    assert list(map(int, by_keys)) == [512, 1024, 2048, 4096] and all(float(f) > 0 for f in by_keys.values())
    numbers = {k: v if k == "collective_by_bytes" else float(v) for k, v in row.items()
               if k not in ("device", "source")}
    assert numbers.pop("streams") == 0 and "2 gloo ranks" in row["source"]  # one CPU thread: ops in line
    latency, wait = numbers.pop("collective_latency_us"), numbers.pop("collective_wait_us")
    assert latency >= 0 and wait >= 0 and latency + wait > 0  # one fit: either may be 0 (ranks in step: no wait)
    by_bytes = parse_collectives({"collective_by_bytes": numbers.pop("collective_by_bytes")}, "cpu")
    assert [kind for kind, _ in by_bytes] == list(MEASURED_COLLECTIVES)
    assert all(len(points) == 4 and all(s > 0 for _, s in points) for _, points in by_bytes), by_bytes
    assert all(v > 0 for v in numbers.values()), numbers
    path = write_cpu_rates(row, tmp_path / "rates.csv")
    rows = {r["device"]: r for r in csv.DictReader(path.open())}
    assert rows["cpu"]["peak_tflops"] == row["peak_tflops"] and "h100-80gb" in rows


def test_latency_and_wait_are_one_least_squares_line_in_the_square_root_of_the_work_never_below_zero():
    from autosp.experiments.calibrate import fit_latency_and_wait

    planted = [(work, 150e-6 + 300e-6 * math.sqrt(work / 1e-3)) for work in (0.0, 0.7e-3, 3e-3, 12e-3)]
    assert fit_latency_and_wait(planted) == pytest.approx((150e-6, 300e-6))
    shrinking = [(0.0, 4e-4), (1e-3, 3e-4), (4e-3, 2e-4)]  # more work, less time: no wait
    assert fit_latency_and_wait(shrinking) == pytest.approx((3e-4, 0.0))
    through_origin = [(0.0, 0.0), (1e-3, 2e-4), (4e-3, 7e-4)]  # the line's intercept is below 0
    latency, wait = fit_latency_and_wait(through_origin)
    assert latency == 0.0 and wait == pytest.approx((2e-4 + 2 * 7e-4) / 5)


def test_calibration_recovers_a_planted_latency_and_wait_from_an_all_reduce_that_costs_them(monkeypatch):
    """`autosp calibrate`'s measurement, single-process: an all-reduce that spins 2 ms + 1 ms x sqrt(ms of work since
    the previous one) comes back as latency 2 ms and wait 1 ms, within 10%. The stretches of work spin too (50 us a
    matmul), and everything is timed in this thread's CPU seconds: under the suite's two workers real matmuls timed by
    the wall clock put 7.2 ms on a 2.8 ms point."""
    import time

    from autosp.experiments import calibrate as calibrate_module

    latency_s, wait_s, last = 2e-3, 1e-3, [time.thread_time()]

    def all_reduce(tensor) -> None:
        end = time.thread_time() + latency_s + wait_s * math.sqrt((time.thread_time() - last[0]) / 1e-3)
        while time.thread_time() < end:
            pass
        last[0] = time.thread_time()

    def spin(a, count: int) -> None:
        end = time.thread_time() + count * 50e-6
        while time.thread_time() < end:
            pass

    monkeypatch.setattr(calibrate_module, "_matmuls", spin)
    monkeypatch.setattr(calibrate_module.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(calibrate_module.dist, "barrier", lambda: None)
    one = torch.ones(1)
    tight = calibrate_module._seconds(lambda: all_reduce(one), 3, 20, time.thread_time)
    points = [(0.0, tight), *calibrate_module._collective_after_work(one, 3, time.thread_time)]
    assert [work for work, _ in points[1:]] == sorted(work for work, _ in points[1:])
    latency, wait = calibrate_module.fit_latency_and_wait(points)
    assert latency == pytest.approx(latency_s, rel=0.1) and wait == pytest.approx(wait_s, rel=0.1), points


def test_the_zero3_hook_clock_stands_still_inside_deepspeeds_collectives_and_counts_a_nested_one_once(monkeypatch):
    """`autosp calibrate` prices a ZeRO-3 coordinator call by this thread's CPU seconds outside the collectives: the
    time model prices those apart, and a gather's wait is the other rank's pace."""
    import time

    from autosp.experiments.calibrate import _clock_outside_collectives
    from baselines.deepspeed_env import import_deepspeed

    import_deepspeed("zero3")
    import deepspeed.comm as dist
    import deepspeed.comm.comm as comm

    def busy(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    monkeypatch.setattr(comm, "all_gather_into_tensor", lambda *a, **k: busy(0.05))
    monkeypatch.setattr(comm, "allgather_fn", lambda *a, **k: (busy(0.05), comm.all_gather_into_tensor())[0])
    with _clock_outside_collectives() as clock:
        start, cpu = clock(), time.thread_time()
        dist.allgather_fn(None, None)  # 0.1 s inside, the nested gather's included once
        busy(0.02)
        inside, outside = time.thread_time() - cpu, clock() - start
    assert inside >= 0.12 and 0.02 <= outside < 0.03, (inside, outside)


def test_calibrating_into_an_older_rates_file_ends_in_one_line(tmp_path, monkeypatch, capsys):
    """`autosp calibrate --out` an older autosp's rates file (other columns): one line and exit 2, the file kept."""
    from importlib import resources

    from autosp import cli
    from autosp.experiments import calibrate as calibrate_module

    old = tmp_path / "rates.csv"
    text = resources.files("autosp.reference").joinpath("device_rates.csv").read_text(encoding="utf-8")
    old.write_text(text.replace("zero3_hook_us", "zero3_fetch_us"), encoding="utf-8")
    monkeypatch.setattr(calibrate_module, "calibrate", lambda world_size, repeats: {"device": "cpu"})
    assert cli.main(["calibrate", "--out", str(old)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("autosp calibrate: error: ") and "rate columns" in line
    assert "zero3_fetch_us" in old.read_text(encoding="utf-8")


def test_attention_is_calibrated_at_the_head_size_of_every_cpu_preset():
    """A CPU flash kernel's rate per FLOP depends on the head size (docs/measurements/2026-12-07-time-by-op.md: at
    16 it ran 1.4-1.75x slower than the rate measured at 32); the cpu row prices the CPU presets' attention."""
    from autosp.models import get_preset

    for name in ("tiny", "tiny-mha", "tiny-tied", "small", "llama3-mini"):
        assert get_preset(name).head_dim == CPU_HEAD_DIM, name


def test_time_check_predicts_and_measures_each_cell_and_says_which_miss(tmp_path):
    cells = cell_configs("tiny", ["ulysses[ac=layer]"], [256], world_size=2, memory_budget=1 << 30, steps=1)
    [row] = time_check(cells, repeats=1, out=str(tmp_path / "runs.jsonl"))
    assert row["predicted_s"] > 0 and len(row["runs"]) == 1 and row["measured_s"] == row["runs"][0]
    assert row["error"] == row["predicted_s"] / row["measured_s"] - 1
    text = format_rows([row, {**row, "error": 0.5, "within": False}])
    assert "| ulysses[ac=layer] | 256 |" in text and "MISS" in text and "cells within ±15%" in text


def test_measured_records_are_re_predicted_without_a_run_and_a_missing_cell_is_a_one_line_error(tmp_path):
    import json

    import pytest

    from autosp.experiments.time_check import repredict
    from autosp.harness.config import ConfigError

    cells = cell_configs("tiny", ["ulysses[ac=layer]"], [256, 512], world_size=2, memory_budget=1 << 30, steps=1)
    records = tmp_path / "runs.jsonl"
    lines = [{"config_hash": cells[0][1].config_hash(), "status": "ok", "mode": "measured",
              "iter_time_s": {"median": seconds}} for seconds in (0.5, 0.7, 0.6)]
    lines.append({"config_hash": cells[0][1].config_hash(), "status": "oom", "iter_time_s": None})
    records.write_text("".join(json.dumps(line) + "\n" for line in lines))
    [row] = repredict(cells[:1], str(records))
    assert row["runs"] == [0.5, 0.7, 0.6] and row["measured_s"] == 0.6
    assert row["predicted_s"] > 0 and row["error"] == row["predicted_s"] / 0.6 - 1
    assert f"wall seconds of the records of {records})" in format_rows([row], str(records))
    with pytest.raises(ConfigError, match="no measured record of ulysses\\[ac=layer\\] 512"):
        repredict(cells, str(records))
