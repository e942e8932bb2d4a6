"""The Snakemake workflow: every target plans under every profile, settings are validated, the README's quick
start runs as written, and a reduced run end to end draws every figure and writes every table, with an
injected failing cell recorded and drawn while the other cells finish."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["figure_trainability", "figure_throughput", "figure_memory", "figure_sac", "tables", "all"]
GPU_PROFILES = ["a100", "gh200", "mi250"]
FIGURES = ["trainability", "throughput", "memory", "sac"]


def snakemake(tmp_path: Path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    exe = shutil.which("snakemake")
    if exe is None:
        pytest.fail("snakemake is not installed: pip install -e '.[workflow]'")
    # from the repository root: profiles name their settings relative to it
    return subprocess.run([exe, "--directory", str(tmp_path), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def dry_run(tmp_path: Path, *args: str) -> str:
    proc = snakemake(tmp_path, "-n", "-p", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_every_target_plans_under_every_profile(tmp_path: Path) -> None:
    profiles = [["--profile", "profiles/local"]] + [["--profile", f"profiles/{p}"] for p in GPU_PROFILES]
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is not None:
        profiles += [["--profile", "profiles/slurm", "--configfile", f"profiles/{p}/settings.yaml"]
                     for p in GPU_PROFILES]
    for profile in profiles:  # one planning call per profile, every target named in it
        plan = dry_run(tmp_path, *TARGETS, *profile)
        for figure in FIGURES:
            assert f"figures/{figure}.pdf" in plan and f"results/tables/{figure}.tex" in plan, (profile, figure)
        if profile == ["--profile", "profiles/local"]:  # `all` adds the presets too slow for the quick start
            assert "figures/trainability-all.pdf" in plan and "cpu/P2/llama3-mini/autosp.jsonl" in plan
            assert "cpu/P2/small/zero3.jsonl" in plan and "checks/cpu/P2/hf:small/ds-autosp.json" in plan
    plan = dry_run(tmp_path, "all", "--profile", "profiles/a100", "--cores", "64")  # as on a GPU node
    searches = re.findall(r"Shell command: autosp search --method (\S+) --model (\S+) --world-size 8 --device cuda "
                          r"--dtype bfloat16", plan)
    assert {m for _, m in searches} >= {"llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-2-13b"}
    assert ("ds-autosp", "hf:llama-3.1-8b") in searches and ("autosp", "hf:llama-3.1-8b") in searches
    assert "--memory-budget" not in plan  # the GPUs' own memory
    assert "searching [8 cores, 8 GPUs x 1 nodes]" in plan and "results/trainability/a100-80gb/P8/" in plan
    gh200 = dry_run(tmp_path, "figure_trainability", "--profile", "profiles/gh200", "--cores", "64")
    assert "searching [4 cores, 4 GPUs x 1 nodes]" in gh200  # 4 superchips per node: a cell fits one node
    # a cell spanning nodes could not start (its ranks launch on one node): refused at planning, naming why
    proc = snakemake(tmp_path, "-n", "figure_trainability", "--profile", "profiles/gh200", "--config", "world_size=8")
    assert proc.returncode != 0 and "world_size 8 > gpus_per_node 4" in proc.stdout + proc.stderr


def test_a_bare_snakemake_plans_the_quick_starts_target(tmp_path: Path) -> None:
    """No target named: the quick start's figure (`default_target`), not the first rule of the Snakefile."""
    def outputs(plan: str) -> list[str]:
        return sorted(re.findall(r"^\s+output: (.+)$", plan, re.M))

    bare = outputs(dry_run(tmp_path, "--cores", "2"))
    assert "figures/trainability.png, figures/trainability.pdf" in bare
    assert bare == outputs(dry_run(tmp_path, "figure_trainability", "--cores", "2"))


def test_local_default_plans_one_job_per_cell(tmp_path: Path) -> None:
    plan = dry_run(tmp_path, "figure_trainability", "--cores", "2")
    searches = re.findall(r"Shell command: autosp search --method (\S+) --model (\S+) --world-size 2 --device cpu "
                          r"--dtype float32 --compile-backend (\S+) .*?--memory-budget (\S+)", plan)
    cells = {(m, model) for m, model, _, _ in searches}
    assert len(searches) == len(cells) == 5 + 3  # tiny x 5 methods; the peer, autosp and alst on hf:tiny
    assert {("ds-autosp", "hf:tiny"), ("autosp", "hf:tiny"), ("alst", "hf:tiny")} <= cells
    assert {backend for _, _, backend, _ in searches} == {"inductor"}  # autosp as users run it
    for method in ("autosp", "ulysses", "ring"):  # like with like: the SP methods at ZeRO 3, as zero3 and fsdp
        assert re.search(rf"autosp search --method {method} --model tiny [^\n]*--zero 3 ", plan), method
    assert not re.search(r"autosp search --method ds-autosp [^\n]*--zero", plan)  # its own stage (0/1)
    assert {(model, budget) for _, model, _, budget in searches} == {("tiny", "48MiB"), ("hf:tiny", "48MiB")}
    assert "cell autosp tiny P=2 cpu: searching [2 cores, 0 GPUs x 1 nodes]" in plan  # a core per rank
    assert "autosp check --method ds-autosp --model hf:tiny" in plan  # gradient correctness beside its number
    # autosp runs its default, the planner tiling where a graph does not fit untiled (searched and checked so); no
    # other method is given --tiling
    commands = re.findall(r"Shell command: autosp (search|check) --method (\S+) (.*)", plan)
    tiled = {method for _, method, flags in commands if "--tiling plan" in flags}
    assert tiled == {"autosp"} and all("--tiling" not in flags for _, m, flags in commands if m != "autosp")
    assert {kind for kind, method, _ in commands if method == "autosp"} == {"search", "check"}
    assert "llama3-mini" not in plan and "small" not in plan  # only `all` measures them (the quick start's time)


def test_models_override_uses_the_default_budget(tmp_path: Path) -> None:
    """`--config 'models=[tiny-mha]'` (a model without its own budget) takes the default, not a KeyError."""
    plan = dry_run(tmp_path, "figure_trainability", "--config", "models=[tiny-mha]", "methods=[autosp]")
    assert re.search(r"autosp search --method autosp --model tiny-mha .*--memory-budget 48MiB", plan)


@pytest.mark.parametrize("override, named", [
    ("world_sise=4", "world_sise"),
    ("dtype=fp8", "fp8"),
    ("memory_budget={default: lots}", "lots"),
])
def test_bad_settings_fail_validation_naming_them(tmp_path: Path, override: str, named: str) -> None:
    proc = snakemake(tmp_path, "figure_trainability", "-n", "--config", override)
    assert proc.returncode != 0
    assert named in proc.stdout + proc.stderr and "rror" in proc.stdout + proc.stderr


def _quick_start() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", readme, re.S)
    assert block, "README has a Quick start code block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The two commands verbatim, in their cheap form (the environment already set up, a dry run of the
    main job, the suite collected): a fresh clone runs the same two commands (see .ci/run)."""
    first, second = _quick_start()
    assert first == "bin/autosp-env snakemake --cores all figure_trainability"
    assert second == "bin/autosp-env python -m pytest -q -n 2"
    assert f"{second}\n" in (ROOT / ".ci" / "run").read_text()
    venv = tmp_path / "venv"  # a ready environment: this interpreter, installed as of now
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".autosp-installed").touch()
    env = {**os.environ, "AUTOSP_VENV": str(venv)}
    run = subprocess.run(f"{first} -n --directory {tmp_path / 'wd'}", shell=True, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "cell autosp tiny P=2 cpu: searching" in run.stdout, run.stdout + run.stderr
    run = subprocess.run(f"{second} --collect-only tests/test_workflow.py", shell=True, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "test_readme_quick_start_runs_as_written" in run.stdout, run.stdout + run.stderr


def test_an_interrupted_cell_is_redone_not_recorded(tmp_path: Path) -> None:
    """A cell whose command is interrupted (exit 130, after writing its `interrupted` row, as `autosp search`
    does on SIGTERM) fails its job, so snakemake deletes the row and a rerun searches again."""
    fake = tmp_path / "autosp-interrupted"
    fake.write_text('#!/bin/sh\n'
                    'case "$*" in *--record-failure*) status=error code=0;; *) status=interrupted code=130;; esac\n'
                    'while [ $# -gt 0 ]; do\n'
                    '  [ "$1" = --out ] && echo "{\\"status\\": \\"$status\\"}" >> "$2"; shift\n'
                    'done\n'
                    'exit $code\n')
    fake.chmod(0o755)
    cell = "results/trainability/cpu/P2/tiny/autosp.jsonl"
    proc = snakemake(tmp_path, cell, "--cores", "1", "--config", f"autosp={fake}")
    assert proc.returncode != 0 and not (tmp_path / cell).exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert cell in dry_run(tmp_path, cell, "--config", f"autosp={fake}")


REDUCED = """
models: [tiny]
all_models: []
methods: [autosp, no-such-method]   # the second cell fails: its search exits with a bad-input error
# no peer cell in either scope: without `all_models: []` here config.yaml's peer.all_models adds ds-autosp on
# hf:small (an inductor compile, ~110 CPU-s), on which nothing below asserts
peer: {method: ds-autosp, models: [], all_models: [], compare: [], check: [], check_seq_len: 256}
compile_backend: {default: aot_eager}
memory_budget: {default: 64MiB, tiny: 64MiB}
granularity: 512
min_len: 512
max_len: 512
probe_timeout_s: 300
throughput: {models: [tiny], methods: [autosp], seq_lens: [512], repeats: 1, reference: autosp, memory_budget: none}
activation_memory: {model: tiny, seq_len: 512, methods: [single], baseline: single}
sac: {model: tiny, policies: [sac], seq_len: 512, repeats: 1}
"""


@pytest.mark.slow
def test_reduced_run_draws_every_figure_and_survives_a_failing_cell(tmp_path: Path) -> None:
    settings = tmp_path / "reduced.yaml"
    settings.write_text(REDUCED)
    proc = snakemake(tmp_path, "all", "--cores", "2", "--configfile", str(settings), timeout=1800)  # ~2 min idle
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in FIGURES:
        assert (tmp_path / "figures" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
        assert (tmp_path / "figures" / f"{name}.pdf").read_bytes()[:4] == b"%PDF"
        for suffix in ("csv", "md", "tex"):
            assert (tmp_path / "results" / "tables" / f"{name}.{suffix}").stat().st_size > 0
    assert "\\toprule" in (tmp_path / "results" / "tables" / "trainability.tex").read_text()
    table = (tmp_path / "results" / "tables" / "trainability.csv").read_text()
    failed, = [line for line in table.splitlines() if ",no-such-method," in line]
    assert ",error," in failed and "search exited with status 2: " in failed and "unknown method" in failed
    ok, = [line for line in table.splitlines() if ",autosp," in line]
    assert ",no_oom_up_to_max_len," in ok or ",found," in ok  # the other cell still measured
    rows = [json.loads(x) for x in (tmp_path / "results/memory/cpu/P2/tiny/single.jsonl").read_text().splitlines()]
    assert rows[-1]["extra"]["saved_by_category"]["attention"] > 0 and rows[-1]["world_size"] == 1
    # a rerun redoes nothing finished
    again = snakemake(tmp_path, "all", "--cores", "2", "--configfile", str(settings), "-n")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, again.stdout


def test_searches_are_guided_by_the_simulator_unless_turned_off(tmp_path: Path) -> None:
    pattern = r"Shell command: autosp search --method (\S+) .*?--guide (\S+) "
    guides = dict(re.findall(pattern, dry_run(tmp_path, "figure_trainability", "--cores", "2")))
    # the default settings: guided, but where the simulator is known off (ds-autosp) or cannot run (alst)
    assert guides == {"autosp": "simulate", "ulysses": "simulate", "zero3": "simulate", "fsdp": "simulate",
                      "ring": "simulate", "ds-autosp": "off", "alst": "off"}
    plan = dry_run(tmp_path, "figure_trainability", "--cores", "2", "--config", "search_guide={default: 'off'}")
    assert set(dict(re.findall(pattern, plan)).values()) == {"off"}
