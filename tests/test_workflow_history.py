"""The `regression` and `figure_history` workflow targets, run for real on synthetic stores (the suite itself
is stood in for by a CLI wrapper whose `history run` records nothing, so no training happens)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autosp.experiments.history.store import record_files
from autosp.harness.records import append_record
from tests.experiments.test_history import STEP, bench, noisy

ROOT = Path(__file__).resolve().parents[1]


def snakemake(tmp_path: Path, store: Path, *targets: str) -> subprocess.CompletedProcess:
    exe = shutil.which("snakemake")
    if exe is None:
        pytest.fail("snakemake is not installed: pip install -e '.[workflow]'")
    wrapper = tmp_path / "autosp_wrapper.sh"  # `history run` does nothing; everything else is the real CLI
    wrapper.write_text(f'#!/bin/bash\nif [ "$2" = run ]; then exit 0; fi\nexec {sys.executable} -m autosp.cli "$@"\n')
    wrapper.chmod(0o755)
    cmd = [exe, "--snakefile", str(ROOT / "Snakefile"), "--directory", str(tmp_path), "--cores", "1", *targets,
           "--config", f"autosp={wrapper}", f"history_store={store}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


def history(tmp_path: Path, slowdown: float) -> Path:
    store = tmp_path / "history.sqlite"
    for day, (commit, step) in enumerate((("a", STEP), ("b", STEP * slowdown)), 1):
        path = tmp_path / f"{commit}.jsonl"
        for record in bench(commit * 40, noisy(step, day), noisy(STEP, 10 + day), day=day):
            append_record(path, record)
        record_files(store, [path], reference="ulysses")
    return store


def test_regression_target_fails_on_a_slowdown_and_passes_without(tmp_path: Path) -> None:
    slow = snakemake(tmp_path / "slow", history(tmp_path / "slow", 1.2), "regression")
    assert slow.returncode != 0
    log = (tmp_path / "slow" / "results/logs/history/regression.log").read_text()
    assert "REGRESSION" in log and not (tmp_path / "slow" / "results/history/regression-report.txt").exists()
    same = snakemake(tmp_path / "same", history(tmp_path / "same", 1.0), "regression", "figure_history")
    assert same.returncode == 0, same.stderr
    assert "no regression" in (tmp_path / "same" / "results/history/regression-report.txt").read_text()
    for name in ("figures/history.png", "figures/history.pdf", "results/history/index.html"):
        assert (tmp_path / "same" / name).stat().st_size > 0
