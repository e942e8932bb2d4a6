"""The CPU rehearsal of tests/gpu/throughput_check.sh (issue 43): the GPU script end to end with DEVICE=cpu on
tiny sizes, so a lent GPU's minutes go to measuring. Long profile: about 2 CPU-minutes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import throughput_table  # noqa: E402

pytestmark = pytest.mark.long


def test_the_throughput_script_rehearses_on_cpu_and_its_table_comes_from_its_records(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "DEVICE": "cpu", "PYTHON": sys.executable, "DEADLINE": "900"}
    done = subprocess.run(["bash", "tests/gpu/throughput_check.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1000)
    assert done.returncode == 0 and "] done" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    table = (tmp_path / "table.md").read_text()
    assert table == throughput_table.table(tmp_path) + "\n"  # written by the script from the records alone
    predicted = throughput_table._by_length(tmp_path / "predicted.jsonl")
    runs = throughput_table._by_length(tmp_path / "runs.jsonl")
    assert sorted(predicted) == sorted(runs) == [256, 512, 1024], table
    for n in (256, 512, 1024):
        assert predicted[n]["extra"]["time"]["iteration_s"] > 0 and runs[n]["status"] == "ok"
        assert len(runs[n]["iter_time_s"]["samples"]) == 3  # the timed steps after the warm-up
        row = next(line for line in table.splitlines() if line.startswith(f"| {n} |"))
        assert "(3 steps)" in row and "%" in row.split("|")[7], row
