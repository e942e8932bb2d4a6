"""The Snakemake workflow resolves: `figure_trainability` plans one search per (model, method), a table, a figure."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def dry_run(tmp_path: Path, *config: str) -> str:
    snakemake = shutil.which("snakemake")
    if snakemake is None:
        pytest.fail("snakemake is not installed: pip install -e '.[workflow]'")
    cmd = [snakemake, "-n", "-p", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
           "--cores", "2", "figure_trainability"]
    if config:
        cmd += ["--config", *config]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_default_target_plans_every_search(tmp_path: Path) -> None:
    plan = dry_run(tmp_path)
    searches = re.findall(r"autosp search --method (\S+) --model (\S+) --world-size 2 --memory-budget (\S+)", plan)
    assert len(searches) == len(set(searches)) == 2 * 6  # models tiny, small x six methods
    assert {m for m, _, _ in searches} >= {"autosp", "ulysses", "ds-autosp", "zero3"}
    assert {(model, budget) for _, model, budget in searches} == {("tiny", "48MiB"), ("small", "96MiB")}
    assert "autosp table trainability" in plan and "figures/trainability.png" in plan
    assert re.search(r"rule search:.*?threads: 2", plan, re.S), "each search must reserve its ranks' cores"


def test_gpu_overrides_reach_the_commands(tmp_path: Path) -> None:
    plan = dry_run(tmp_path, "device=cuda", "world_size=8", "models=[llama-3.1-8b]", "methods=[autosp,zero3]",
                   "memory_budget=none", "compile_backend=inductor")
    assert "gpu=8" in plan  # each search holds its 8 GPUs: `--resources gpu=8` keeps searches from sharing them
    commands = [line for line in plan.splitlines() if "autosp search" in line]
    assert len(commands) == 2
    for line in commands:
        assert "--world-size 8" in line and "--device cuda" in line and "--compile-backend inductor" in line
        assert "--memory-budget" not in line and "--granularity" not in line  # GPU memory; 2*P*128 default
