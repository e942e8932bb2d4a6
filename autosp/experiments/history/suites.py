"""The fixed regression suites: a few bench and search cells, run through the `autosp` CLI and recorded.

A cell is an `autosp bench ...` or `autosp search ...` command line, run as a subprocess. That keeps every
cell exactly what a user would type, and lets one suite measure an older commit with that commit's own
code (`--checkout DIR`: the cell runs there, with PYTHONPATH pointing at it), while the recording and the
comparison use this version's code.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from autosp.harness.config import ConfigError


@dataclass(frozen=True)
class Cell:
    name: str
    args: tuple[str, ...]  # `autosp` arguments without --out


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    device: str
    reference: str  # method every bench cell includes; throughput is also stored relative to it
    cells: tuple[Cell, ...]


def _bench(name: str, methods: str, model: str, seq_lens: str, world_size: int, reference: str, *extra: str) -> Cell:
    return Cell(name, ("bench", "--methods", methods, "--model", model, "--seq-lens", seq_lens, "--world-size",
                       str(world_size), "--ratio-to", reference, *extra))


def _search(name: str, method: str, model: str, world_size: int, *extra: str) -> Cell:
    return Cell(name, ("search", "--method", method, "--model", model, "--world-size", str(world_size),
                       "--no-fail-on-error", *extra))


_CPU = ("--device", "cpu", "--compile-backend", "aot_eager")
_CUDA = ("--device", "cuda", "--dtype", "bfloat16", "--compile-backend", "inductor")
SUITES = {suite.name: suite for suite in (
    Suite("cpu", "2 gloo ranks, tiny model: autosp vs ulysses step time at 512 tokens (2 repeats x 5 steps), "
          "autosp's max length under 24 MiB (guided by the simulator: 2 probes where it is right). ~6 runs, a "
          "few minutes on 2 cores", "cpu", "ulysses", (
              _bench("bench-tiny-512", "autosp,ulysses", "tiny", "512", 2, "ulysses",
                     "--repeats", "2", "--steps", "5", *_CPU),
              # the search's default guide: the simulator's answer and one step above it are measured, and whether
              # they were as predicted is recorded (`simulator_agrees`); a commit before the guide searches plainly
              _search("search-tiny-autosp", "autosp", "tiny", 2, "--memory-budget", "24MiB", *_CPU),
          )),
    Suite("cuda", "8 GPUs, llama-3.2-1b: autosp / ulysses / zero3 step time at 8K and 32K (3 repeats x 10 "
          "steps) and the max length of autosp and ulysses", "cuda", "ulysses", (
              _bench("bench-1b", "autosp,ulysses,zero3", "llama-3.2-1b", "8192,32768", 8, "ulysses",
                     "--repeats", "3", "--steps", "10", *_CUDA),
              _search("search-1b-autosp", "autosp", "llama-3.2-1b", 8, *_CUDA),
              _search("search-1b-ulysses", "ulysses", "llama-3.2-1b", 8, *_CUDA),
          )),
)}


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise ConfigError(f"no suite {name!r}; suites: {', '.join(SUITES)}")
    return SUITES[name]


def run_suite(suite: Suite, *, out_dir: str | os.PathLike, autosp_cmd: str = "autosp",
              checkout: str | os.PathLike | None = None, timeout_s: float = 3600) -> tuple[list[Path], list[str]]:
    """Run every cell; return (the results files written, the names of cells that failed).

    Each cell's output goes to `<out_dir>/<cell>.log`; a failed cell does not stop the others."""
    from autosp.experiments.progress import progress

    if suite.device == "cuda" and checkout is None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"suite {suite.name!r} needs CUDA GPUs and this machine has none; use --suite cpu")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    cwd = None
    if checkout is not None:
        checkout = Path(checkout).resolve()
        if not (checkout / "autosp").is_dir():
            raise ConfigError(f"--checkout {checkout} holds no autosp package; give a checkout of this repository")
        env["PYTHONPATH"] = str(checkout)
        cwd = checkout
    written, failed = [], []
    started = time.monotonic()
    with progress(suite.cells, desc=f"suite {suite.name}") as bar:
        for index, cell in enumerate(bar):
            bar.set_postfix_str(cell.name)
            out = (out_dir / f"{cell.name}.jsonl").resolve()
            command = [*shlex.split(autosp_cmd), *cell.args, "--out", str(out)]
            print(f"[{index + 1}/{len(suite.cells)}] {cell.name} ({time.monotonic() - started:.0f} s elapsed): "
                  f"{shlex.join(command)}", flush=True)
            with open(out_dir / f"{cell.name}.log", "w", encoding="utf-8") as log:
                try:
                    code = subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          timeout=timeout_s, check=False).returncode
                except subprocess.TimeoutExpired:
                    code = "timeout"
            if code != 0:
                failed.append(cell.name)
                print(f"  {cell.name} failed ({code}); see {out_dir / (cell.name + '.log')}", flush=True)
            if out.exists():
                written.append(out)
    return written, failed


def default_out_dir(root: str | os.PathLike, suite: Suite) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path(root) / f"{stamp}-{suite.name}"
