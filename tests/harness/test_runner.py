import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.launch import free_port
from autosp.harness.records import FIELDS, load_records
from autosp.harness.runner import global_batch, run, validate

MEASURED = ("implementation", "device_name", "peak_mem_bytes", "peak_mem_by_rank", "iter_time_s", "tokens_per_s",
            "loss", "git_commit", "versions", "hostname", "timestamp", "config_hash")


def test_run_writes_a_complete_record_and_the_loss_falls(tmp_path) -> None:
    out = tmp_path / "runs.jsonl"
    cfg = RunConfig(method="single", model="tiny", seq_len=256, steps=4, warmup=2, lr=3e-3, timeout_s=120)
    record = run(cfg, out=out)
    assert record["status"] == "ok", record["error"]
    assert set(FIELDS) <= set(record)
    assert all(record[k] is not None for k in MEASURED), {k: record[k] for k in MEASURED}
    assert record["error"] is None and record["memory_budget"] is None
    assert len(record["iter_time_s"]["samples"]) == 4
    times = record["iter_time_s"]
    assert 0 < times["min"] <= times["median"] <= times["max"]
    assert record["tokens_per_s"] == pytest.approx(256 / times["median"])
    assert record["peak_mem_by_rank"] == [record["peak_mem_bytes"]]
    losses = record["extra"]["losses"]
    assert len(losses) == 2 + 1 + 4  # warm-up, measured step, timed steps
    assert all(b < a for a, b in itertools.pairwise(losses)), losses  # fits the fixed batch: strictly falling
    assert record["loss"] == losses[-1]
    df = load_records(out)
    assert len(df) == 1 and df["run_id"][0] == record["run_id"]


def test_two_ranks_report_every_rank() -> None:
    record = run(RunConfig(method="fsdp", model="tiny", seq_len=128, world_size=2, steps=2, timeout_s=120))
    assert record["status"] == "ok", record["error"]
    assert len(record["peak_mem_by_rank"]) == 2 and record["peak_mem_bytes"] == max(record["peak_mem_by_rank"])
    assert record["dp_size"] == 2 and record["sp_size"] == 1
    assert record["tokens_per_s"] == pytest.approx(2 * 128 / record["iter_time_s"]["median"])


def test_global_batch_rows_follow_the_data_parallel_degree() -> None:
    cfg = RunConfig(method="fsdp", model="tiny", seq_len=64, world_size=4, batch_size=2)
    assert global_batch(cfg, sp_size=1).input_ids.shape == (8, 64)
    assert global_batch(cfg, sp_size=4).input_ids.shape == (2, 64)
    assert not global_batch(cfg, 1, step=0).input_ids.equal(global_batch(cfg, 1, step=1).input_ids)


@pytest.mark.parametrize("change,message", [
    ({"seq_len": 0}, "--seq-len must be positive"), ({"batch_size": -1}, "--batch-size must be positive"),
    ({"warmup": -1}, "--warmup must be non-negative"), ({"dtype": "float8"}, "unknown --dtype"),
    ({"compile_backend": "tvm"}, "unknown --compile-backend"), ({"sac": "most"}, "unknown --sac"),
    ({"memory_budget": 0}, "--memory-budget must be positive"), ({"model": "gpt"}, "unknown model"),
    ({"method": "nope"}, "unknown method 'nope'; valid methods: .*single"),
])
def test_bad_configurations_are_config_errors(change, message) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(RunConfig(method="single", model="tiny", seq_len=64).replace(**change))


def test_inside_a_torchrun_job_every_rank_runs_and_rank_0_records(tmp_path) -> None:
    out = tmp_path / "runs.jsonl"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", "autosp", "run", "--method", "fsdp", "--model", "tiny",
                           "--seq-len", "128", "--world-size", "2", "--steps", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=root, check=False,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("ok: fsdp tiny seq 128 x 2 rank(s)") == 2
    records = load_records(out)
    assert len(records) == 1 and len(records["peak_mem_by_rank"][0]) == 2


def test_float16_nan_is_an_error_not_a_measurement(tmp_path) -> None:
    """pure float16 on CPU diverges at once on this model: the run must say so, never report the NaN as ok."""
    out = tmp_path / "runs.jsonl"
    cfg = RunConfig(method="ulysses", model="tiny", seq_len=128, world_size=2, dtype="float16-pure", steps=2, warmup=1,
                    timeout_s=120, zero=0)
    record = run(cfg, out=out)
    assert record["status"] == "error" and "training diverged" in record["error"], record["error"]
    assert "loss is nan at step" in record["error"]
    assert load_records(out)["status"].tolist() == ["error"]
