import pytest
import torch

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.measure import CpuAllocationMeter, format_size, parse_size, settled_collectives, summarize_times
from autosp.harness.runner import run


@pytest.mark.parametrize("text,expected", [("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29), ("800MB", 800 * 10**6),
                                           ("4096", 4096), ("2 kib", 2048), (1000, 1000)])
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["12XB", "MiB", "-5MiB", "0", ""])
def test_parse_size_rejects(text) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


def test_format_and_summaries() -> None:
    assert format_size(1536) == "1.50 KiB"
    assert summarize_times([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "samples": [3.0, 1.0, 2.0]}


def test_cpu_meter_replays_allocations_exactly() -> None:
    meter = CpuAllocationMeter()
    with meter.session():
        resident = torch.empty(1000, dtype=torch.uint8)  # live before the measured step
        transient = torch.empty(5000, dtype=torch.uint8)
        del transient  # freed before the step: not part of its peak
        with meter.measured_step():
            a = torch.empty(3000, dtype=torch.uint8)
            del a
            b = torch.empty(2000, dtype=torch.uint8)
            del b
    report = meter.report()
    assert report.detail["resident_at_step_start_bytes"] == 1000
    assert report.detail["step_increase_bytes"] == 3000
    assert report.peak_bytes == 4000
    assert report.detail["peak_including_setup_bytes"] == 6000
    assert report.detail["peak_op"] == "aten::empty"  # the op whose allocation set the peak
    del resident


def test_cpu_meter_ignores_the_free_of_a_tensor_made_before_it_started() -> None:
    """Garbage from an earlier profiled run (a tensor in a cycle the collector frees mid-run) is freed where this
    profiler sees it, with its size (torch remembers sizes allocated under any profiler), but its allocation is not
    in this profile: the count must not drop for it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
        earlier = torch.empty(8, dtype=torch.uint8)  # an earlier run's tensor, outliving its profile
    meter = CpuAllocationMeter()
    with meter.session():
        resident = torch.empty(1000, dtype=torch.uint8)
        del earlier  # freed inside this session
        with meter.measured_step():
            a = torch.empty(3000, dtype=torch.uint8)
            del a
    report = meter.report()
    assert report.detail["resident_at_step_start_bytes"] == 1000
    assert report.peak_bytes == 4000
    del resident


def _cfg(seq_len: int, **kw) -> RunConfig:
    return RunConfig(method="single", model="tiny", seq_len=seq_len, steps=1, warmup=1, timeout_s=120, **kw)


def test_cpu_peak_is_deterministic_and_grows_with_sequence_length() -> None:
    first, second, double = run(_cfg(256)), run(_cfg(256)), run(_cfg(512))
    assert first["status"] == second["status"] == double["status"] == "ok"
    assert first["peak_mem_bytes"] == second["peak_mem_bytes"] > 0
    assert double["peak_mem_bytes"] > 1.5 * first["peak_mem_bytes"]
    assert first["extra"]["memory"]["memory_kind"] == "cpu-profiler-allocations"


def test_two_rank_peak_is_deterministic() -> None:
    """Collectives free tensors from gloo's worker threads unless the meter settles them (see
    autosp.harness.measure)."""
    cfg = RunConfig(method="ulysses", model="tiny", seq_len=512, world_size=2, steps=1, warmup=1, timeout_s=180,
                    zero=0)
    first, second = run(cfg), run(cfg)
    assert first["status"] == second["status"] == "ok", (first["error"], second["error"])
    assert first["peak_mem_by_rank"] == second["peak_mem_by_rank"]


def test_settled_collectives_restores_wait() -> None:
    original = torch.distributed.Work.wait
    with settled_collectives():
        assert torch.distributed.Work.wait is not original
    assert torch.distributed.Work.wait is original


def test_peak_above_budget_is_oom() -> None:
    record = run(_cfg(256, memory_budget=2**20))
    assert record["status"] == "oom"
    assert "exceeds the memory budget 1.00 MiB" in record["error"]
    assert record["peak_mem_bytes"] > 2**20 and record["iter_time_s"]["samples"] == []
    roomy = run(_cfg(256, memory_budget=2**30))
    assert roomy["status"] == "ok" and roomy["memory_budget"] == 2**30


def test_sizes_compared_in_one_message_read_differently() -> None:
    from autosp.harness.measure import format_sizes_apart

    assert format_sizes_apart(4_445_000, 4_444_000) == ["4.2391 MiB", "4.2381 MiB"]
    assert format_sizes_apart(2**30 + 1, 2**30) == ["1073741825 B", "1073741824 B"]
    assert format_sizes_apart(3 * 2**20, 2**20) == ["3.00 MiB", "1.00 MiB"]


def test_cpu_meter_books_offloaded_copies_as_host_memory() -> None:
    """On CPU the device is host memory: what `autosp_sp::offload` allocates (and its free at that address)
    is booked apart from the emulated device's peak (autosp.compiler.memory.offload)."""
    from autosp.compiler.memory import offload  # noqa: F401  (registers the ops)

    meter = CpuAllocationMeter()
    with meter.session(), meter.measured_step():
        x = torch.empty(3000, dtype=torch.uint8)
        host = torch.ops.autosp_sp.offload(x)  # host 3000
        del x
        y = torch.empty(1000, dtype=torch.uint8)
        back = torch.ops.autosp_sp.reload(host, torch.device("cpu"))  # device 1000 + 3000
        del host, back, y
        z = torch.empty(3500, dtype=torch.uint8)  # may reuse the host copy's address: device memory again
        del z
    report = meter.report()
    assert report.peak_bytes == 4000  # 7000 if the host copy were booked to the device
    assert report.detail["host_offloaded_bytes"] == 3000
