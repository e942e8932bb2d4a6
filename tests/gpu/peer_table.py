"""The peer table of tests/gpu/peer_check.sh, made from the records it leaves in OUT (nothing typed by hand).

    python3 tests/gpu/peer_table.py OUT                   # the table (Markdown), one row per method
    python3 tests/gpu/peer_table.py OUT --common-length   # the shortest measured maximum: the step-time length
    python3 tests/gpu/peer_table.py OUT --predicted METHOD  # the simulator's maximum for METHOD (empty: none)

Per method: the simulator's predicted maximum (predicted.jsonl), the measured maximum and the oom above it
(search.jsonl: the two probes that bracket it), the device peak measured at that length beside the simulated peak
of the same length, host bytes, the steady-state step time and tokens/s at the common length (bench.jsonl), and
the gradient check on the device (check-<method>.json).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from autosp.harness.method_spec import spec_label


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def method_of(config: dict) -> str:
    """A record's method as the script names it: its spec without the compile backend (one for the whole script)."""
    return spec_label({k: v for k, v in config.items() if k != "compile_backend"})


def _by_method(rows: list[dict], kind: str) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for row in rows:
        if row.get("kind", "run") == kind:
            grouped.setdefault(method_of(row["config"]), []).append(row)
    return grouped


def predicted_maximum(out: Path, method: str) -> int | None:
    rows = _by_method(_rows(out / "predicted.jsonl"), "search").get(method, [])
    return rows[-1].get("max_seq_len") if rows else None


def _size(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


def _host(row: dict) -> int | None:
    extra = row.get("extra") or {}
    return (extra.get("breakdown") or extra.get("memory") or {}).get("host_offloaded_bytes")


def _peak_at(runs: list[dict], seq_len: int | None) -> dict | None:
    return next((r for r in reversed(runs) if r["seq_len"] == seq_len and r.get("peak_mem_bytes")), None)


def measured_maxima(out: Path) -> dict[str, int]:
    searches = _by_method(_rows(out / "search.jsonl"), "search")
    return {m: rows[-1]["max_seq_len"] for m, rows in searches.items() if rows[-1].get("max_seq_len")}


def _check(out: Path, method: str) -> str:
    path = out / f"check-{method.split('[')[0]}.json"
    if not path.exists():
        return "-"
    report = json.loads(path.read_text())
    if report.get("status") != "ok":
        return f"{report.get('status')}: {(report.get('error') or '')[:60]}"
    worst = max((report.get("grad_errors") or {}).items(), key=lambda kv: kv[1], default=("-", float("nan")))
    return f"{'PASSED' if report['passed'] else 'FAILED'} (worst {worst[0]} {worst[1]:.1e})"


def table(out: Path) -> str:
    predicted = _by_method(_rows(out / "predicted.jsonl"), "search")
    simulated_runs = _by_method(_rows(out / "predicted.jsonl"), "run")
    searches = _by_method(_rows(out / "search.jsonl"), "search")
    measured_runs = _by_method(_rows(out / "search.jsonl"), "run")
    bench = _by_method(_rows(out / "bench.jsonl"), "run")
    methods = list(dict.fromkeys([*searches, *predicted, *bench]))
    lines = ["| method | predicted max | measured max | oom at | device peak at max, measured / simulated | host | "
             "step at common length (s, median of medians) | tokens/s | gradient check |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method in methods:
        pred = (predicted.get(method) or [{}])[-1]
        found = (searches.get(method) or [{}])[-1]
        at_max = found.get("max_seq_len")
        run = _peak_at(measured_runs.get(method, []), at_max)
        sim_probe = next((p for p in pred.get("probes", []) if p["seq_len"] == at_max), None)
        sim_peak = sim_probe["peak_mem_bytes"] if sim_probe else None
        if sim_peak is None:
            sim = _peak_at(simulated_runs.get(method, []), at_max)
            sim_peak = sim["peak_mem_bytes"] if sim else None
        timed = [r for r in bench.get(method, []) if r["status"] == "ok" and r.get("iter_time_s")]
        step = statistics.median(r["iter_time_s"]["median"] for r in timed) if timed else None
        tokens = statistics.median(r["tokens_per_s"] for r in timed) if timed else None
        bench_status = (bench.get(method) or [{}])[-1].get("status", "-")
        lines.append(
            f"| {method} | {pred.get('max_seq_len') or pred.get('status', '-')} | "
            f"{at_max or found.get('status', '-')} | {found.get('first_oom_seq_len') or '-'} | "
            f"{_size(run['peak_mem_bytes'] if run else None)} / {_size(sim_peak)} | "
            f"{_size(_host(run) if run else None)} | "
            f"{f'{step:.3f}' if step else bench_status} | {f'{tokens:,.0f}' if tokens else '-'} | "
            f"{_check(out, method)} |")
    common = min(measured_maxima(out).values(), default=None)
    lines.append(f"\ncommon length: {common or '-'}; records in {out} (predicted.jsonl, search.jsonl, bench.jsonl, "
                 "check-*.json)")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    if argv[1:] == ["--common-length"]:
        print(min(measured_maxima(out).values(), default=""))
    elif argv[1:2] == ["--predicted"]:
        print(predicted_maximum(out, argv[2]) or "")
    else:
        print(table(out))


if __name__ == "__main__":
    main(sys.argv[1:])
