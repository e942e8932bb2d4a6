"""The CPU rehearsal of tests/gpu/peer_check.sh (issue 47): the GPU script end to end with DEVICE=cpu on hf:tiny
(untied, as alst needs), so a lent GPU's minutes go to measuring. Long profile: about 4 CPU-minutes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import peer_table  # noqa: E402

pytestmark = pytest.mark.long


def test_the_peer_script_rehearses_on_cpu_and_its_table_comes_from_its_records(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "DEVICE": "cpu", "PYTHON": sys.executable, "DEADLINE": "1200"}
    done = subprocess.run(["bash", "tests/gpu/peer_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0 and "] done" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    table = (tmp_path / "table.md").read_text()
    assert table == peer_table.table(tmp_path) + "\n"  # written by the script from the records alone
    maxima = peer_table.measured_maxima(tmp_path)
    assert set(maxima) == {"autosp", "alst", "single[ac=layer]"}, table
    searches = [r for r in peer_table._rows(tmp_path / "search.jsonl") if r.get("kind") == "search"]
    for row in searches:  # every measured maximum bracketed by two real runs: it fits, one granule above does not
        probes = {p["seq_len"]: p["status"] for p in row["probes"]}
        assert probes[row["max_seq_len"]] == "ok" and probes[row["first_oom_seq_len"]] == "oom", row["probes"]
        assert row["first_oom_seq_len"] == row["max_seq_len"] + row["granularity"]
    assert {r["method"] for r in peer_table._rows(tmp_path / "bench.jsonl") if r["status"] == "ok"} == \
        {"autosp", "alst", "single"}
    assert "PASSED" in table.split("| autosp |")[1].splitlines()[0]  # autosp's gradient check on the device
    assert "lm_head" in table.split("| alst |")[1].splitlines()[0]   # alst's known LM-head scale, reported as it is
