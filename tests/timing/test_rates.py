"""Device rates (`autosp/reference/device_rates.csv`) and collective volumes."""
from __future__ import annotations

import csv
from importlib import resources

import pytest

from autosp.timing import collective_bytes, device_rates
from autosp.timing.rates import COLUMNS, RatesError, write_cpu_rates


def test_collectives_send_their_ring_volumes():
    assert collective_bytes("all_gather", 800, 8) == 700
    assert collective_bytes("reduce_scatter", 800, 8) == 700
    assert collective_bytes("all_to_all", 800, 4) == 600
    assert collective_bytes("all_reduce", 800, 8) == 1400
    with pytest.raises(ValueError, match="unknown collective kind 'gossip'"):
        collective_bytes("gossip", 1, 2)


def test_a_group_across_nodes_runs_at_the_node_link():
    h100 = device_rates("h100-80gb")
    inside = h100.collective_seconds("all_to_all", 8e9, 8, gpus_per_node=8)
    across = h100.collective_seconds("all_to_all", 8e9, 16, gpus_per_node=8)
    assert inside == pytest.approx(7e9 / 450e9)
    assert across == pytest.approx(7.5e9 / 50e9)
    assert h100.collective_seconds("all_reduce", 8e9, 1, gpus_per_node=8) == 0.0


def test_every_gpu_row_has_rates_with_a_source_and_a_memory_entry():
    memory = {row["device"] for row in csv.DictReader(
        resources.files("autosp.reference").joinpath("device_memory.csv").open(encoding="utf-8"))}
    rows = list(csv.DictReader(resources.files("autosp.reference").joinpath("device_rates.csv").open(
        encoding="utf-8")))
    assert tuple(rows[0]) == COLUMNS
    for row in rows:
        assert row["device"] in memory and row["source"], row["device"]
        if row["device"] != "cpu":
            rates = device_rates(row["device"])
            assert 0 < rates.matmul_flops <= rates.peak_flops and rates.attention_flops <= rates.peak_flops
            assert rates.streams


def test_a_zero3_hook_call_costs_the_measured_host_seconds_on_the_cpu_row_only():
    """DeepSpeed ZeRO-3's coordinator per call: measured by `autosp calibrate` on the cpu row; no GPU host measured
    it, so the GPU rows price it at nothing (not modelled there)."""
    cpu = device_rates("cpu")
    assert cpu.zero3_hook_s > 0 and cpu.zero3_hook_seconds(270) == pytest.approx(270 * cpu.zero3_hook_s)
    assert device_rates("h100-80gb").zero3_hook_seconds(270) == 0.0


def test_the_wait_for_the_slower_rank_grows_with_the_square_root_of_the_work_on_the_cpu_row_only():
    """Measured by `autosp calibrate` on the cpu row (0 where the ranks stayed in step); the GPU rows price no wait
    (not measured on a GPU)."""
    cpu = device_rates("cpu")
    assert cpu.collective_wait_s >= 0 and cpu.rank_wait_seconds(1e-3) == pytest.approx(cpu.collective_wait_s)
    assert cpu.rank_wait_seconds(4e-3) == pytest.approx(2 * cpu.collective_wait_s) and cpu.rank_wait_seconds(0) == 0
    assert device_rates("h100-80gb").rank_wait_seconds(1.0) == 0.0


def test_an_unknown_device_is_refused_in_one_line():
    with pytest.raises(RatesError, match="no rates for device 'tpu'"):
        device_rates("tpu")


def test_a_calibration_replaces_the_cpu_row_only(tmp_path):
    target = tmp_path / "rates.csv"
    target.write_text(resources.files("autosp.reference").joinpath("device_rates.csv").read_text(encoding="utf-8"))
    write_cpu_rates({"device": "cpu", "peak_tflops": "0.05", "source": "measured"}, target)
    rows = {row["device"]: row for row in csv.DictReader(target.open(encoding="utf-8"))}
    assert rows["cpu"]["peak_tflops"] == "0.05" and rows["cpu"]["source"] == "measured"
    assert rows["h100-80gb"]["peak_tflops"] == "989"


def test_a_calibration_into_a_file_of_other_columns_is_refused_in_one_line(tmp_path):
    """A rates file an older autosp wrote (its ZeRO-3 column was `zero3_fetch_us`, per fetched parameter)."""
    target = tmp_path / "rates.csv"
    package = resources.files("autosp.reference").joinpath("device_rates.csv").read_text(encoding="utf-8")
    target.write_text(package.replace("zero3_hook_us", "zero3_fetch_us"), encoding="utf-8")
    with pytest.raises(RatesError, match=r"does not have this autosp's rate columns \(device, .*zero3_hook_us"):
        write_cpu_rates({"device": "cpu", "peak_tflops": "0.05", "source": "measured"}, target)
    assert target.read_text(encoding="utf-8") == package.replace("zero3_hook_us", "zero3_fetch_us")  # untouched


def test_an_attention_rate_measured_by_key_length_is_read_between_and_beyond_the_lengths(tmp_path):
    """`attention_by_keys`: linear in log2 of the key length between two measured lengths, the end's rate beyond
    them; a row without it (the GPU rows) has one attention rate at every length."""
    from dataclasses import replace

    h100 = device_rates("h100-80gb")
    assert h100.attention_by_keys == () and h100.attention_rate(4096) == h100.attention_flops
    rates = replace(h100, attention_by_keys=((1024, 1e11), (4096, 3e11)))
    assert rates.attention_rate(2048) == pytest.approx(2e11)
    assert rates.attention_rate(512) == 1e11 and rates.attention_rate(8192) == 3e11
    assert rates.attention_seconds(6e11, 2048) == pytest.approx(3.0)
    assert rates.attention_rate(0) == h100.attention_flops  # a kernel of unknown length: the one rate


def test_a_malformed_attention_by_keys_is_refused_in_one_line():
    from autosp.timing.rates import parse_by_keys

    assert parse_by_keys({"attention_by_keys": "2048:0.7 1024:0.5"}, "cpu") == [(1024, 0.5), (2048, 0.7)]
    with pytest.raises(RatesError, match="cpu's attention_by_keys '1024=0.5' is not 'keys:fraction"):
        parse_by_keys({"attention_by_keys": "1024=0.5"}, "cpu")
    with pytest.raises(RatesError, match="a length or fraction <= 0"):
        parse_by_keys({"attention_by_keys": "1024:0"}, "cpu")


def test_a_collective_measured_by_bytes_is_priced_from_its_points_and_the_rest_by_latency_and_link():
    """`collective_by_bytes` (the cpu row's, from `autosp calibrate`): linear in the bytes one rank sends between two
    measured sizes, the smallest's time below them, the largest's rate above them; a kind it does not state, a
    group across nodes and a row without it (the GPU rows) are priced by latency + bytes / link."""
    from dataclasses import replace

    h100 = device_rates("h100-80gb")
    assert h100.collective_by_bytes == ()
    rates = replace(h100, collective_by_bytes=(("all_reduce", ((8.0, 2e-4), (65536.0, 1e-3), (1 << 20, 4e-3))),))
    assert rates.collective_seconds("all_reduce", 8, 2, gpus_per_node=8) == 2e-4  # sends 8 B
    assert rates.collective_seconds("all_reduce", 2, 2, gpus_per_node=8) == 2e-4  # below the smallest
    halfway = (8 + 65536) / 2  # sent bytes; an all-reduce over two ranks sends the tensor's bytes
    assert rates.collective_seconds("all_reduce", halfway, 2, gpus_per_node=8) == pytest.approx(6e-4)
    assert rates.collective_seconds("all_reduce", 4 << 20, 2, gpus_per_node=8) == pytest.approx(16e-3)
    assert rates.collective_seconds("all_reduce", 4 << 20, 4, gpus_per_node=8) == pytest.approx(24e-3)  # sends 1.5x
    assert rates.collective_seconds("all_gather", 1e9, 2, gpus_per_node=8) == h100.collective_seconds(
        "all_gather", 1e9, 2, gpus_per_node=8)
    assert rates.collective_seconds("all_reduce", 1e9, 16, gpus_per_node=8) == h100.collective_seconds(
        "all_reduce", 1e9, 16, gpus_per_node=8)
    assert rates.collective_seconds("all_reduce", 1e9, 1, gpus_per_node=8) == 0.0


def test_a_malformed_collective_by_bytes_is_refused_in_one_line():
    from autosp.timing.rates import parse_collectives

    assert parse_collectives({"collective_by_bytes": "all_reduce:65536:900 all_reduce:8:250 all_gather:4:300"},
                             "cpu") == (("all_reduce", ((8.0, 250e-6), (65536.0, 900e-6))),
                                        ("all_gather", ((4.0, 300e-6),)))
    assert parse_collectives({"collective_by_bytes": ""}, "h100-80gb") == ()
    with pytest.raises(RatesError, match="cpu's collective_by_bytes 'all_reduce:8' is not 'kind:bytes:us"):
        parse_collectives({"collective_by_bytes": "all_reduce:8"}, "cpu")
    with pytest.raises(RatesError, match="names gossip; one of all_gather"):
        parse_collectives({"collective_by_bytes": "gossip:8:250"}, "cpu")
    with pytest.raises(RatesError, match="a time <= 0"):
        parse_collectives({"collective_by_bytes": "all_reduce:8:0"}, "cpu")
    with pytest.raises(RatesError, match="one kind twice at one size"):
        parse_collectives({"collective_by_bytes": "all_reduce:8:250 all_reduce:8:300"}, "cpu")
