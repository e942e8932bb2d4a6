"""The table of tests/gpu/throughput_check.sh, made from the records it leaves in OUT (nothing typed by hand).

    python3 tests/gpu/throughput_table.py OUT

Per length: the predicted step, tokens/s and MFU (predicted.jsonl: the simulator's `extra.time`, a prediction), the
measured steady-state step (runs.jsonl: the median of the timed steps) and its tokens/s, predicted/measured - 1, the
measured peak beside the simulated one, and the GPU's mean utilisation over the timed steps (smi.csv, sampled every
second, the samples in the last steps x median seconds of the run's window in windows.csv; empty on a CPU).
"""
from __future__ import annotations

import csv
import datetime
import json
import sys
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _by_length(path: Path) -> dict[int, dict]:
    return {row["seq_len"]: row for row in _rows(path)}  # the last record of a length wins


def utilisation(out: Path, seq_len: int, seconds: float) -> float | None:
    """Mean GPU utilisation (%) over the last `seconds` of the run at `seq_len`, or None without samples."""
    windows = {int(r["seq_len"]): float(r["end"]) for r in csv.DictReader((out / "windows.csv").open())} \
        if (out / "windows.csv").exists() else {}
    if seq_len not in windows or not (out / "smi.csv").exists():
        return None
    end = windows[seq_len]
    samples = []
    for line in (out / "smi.csv").read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2 or not parts[1].rstrip(" %").isdigit():
            continue
        when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        if end - seconds <= when <= end:
            samples.append(int(parts[1].rstrip(" %")))
    return sum(samples) / len(samples) if samples else None


def table(out: Path) -> str:
    predicted, runs = _by_length(out / "predicted.jsonl"), _by_length(out / "runs.jsonl")
    lines = ["| tokens | predicted step (s) | predicted tok/s | predicted MFU | measured step (s) | measured tok/s | "
             "predicted/measured - 1 | peak measured (simulated) | GPU busy | status |", "|" + "---|" * 10]
    for n in sorted(set(predicted) | set(runs)):
        p, r = predicted.get(n, {}), runs.get(n, {})
        time = (p.get("extra") or {}).get("time") or {}
        step = (r.get("iter_time_s") or {}).get("median")
        steps = len((r.get("iter_time_s") or {}).get("samples") or [])
        busy = utilisation(out, n, steps * step) if step else None
        cells = [str(n), _num(time.get("iteration_s"), ".3f"), _num(time.get("tokens_per_s_per_gpu"), ",.0f"),
                 _num(time.get("mfu"), ".0%"), _num(step, ".3f") + (f" ({steps} steps)" if steps else ""),
                 _num(r.get("tokens_per_s"), ",.0f"),
                 f"{time['iteration_s'] / step - 1:+.1%}" if step and time.get("iteration_s") else "-",
                 f"{_gib(r.get('peak_mem_bytes'))} ({_gib(p.get('peak_mem_bytes'))})",
                 "-" if busy is None else f"{busy:.0f}%",
                 f"run {r.get('status', '-')}, simulated {p.get('status', '-')}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nPredicted: the simulator's time model (docs/simulator.md); measured: `autosp run`."


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1 << 30):.2f} GiB"


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
