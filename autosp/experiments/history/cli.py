"""`autosp history record|run|compare|bisect-hint|plot|list`: the regression history on the command line.

`run --commits A..B` records a range of commits, each with its own code (`history.commits`).

`compare` exits 1 when any series regressed (throughput beyond the threshold and significant, or any
trainability loss), so CI and the `regression` workflow target can gate on it.
"""
from __future__ import annotations

import argparse

from autosp.experiments.history.store import DEFAULT_ALPHA, DEFAULT_STORE
from autosp.harness.config import ConfigError


def parse_threshold(text: str) -> float:
    """`5%` or `0.05` -> 0.05."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ConfigError(f"--threshold takes a fraction or a percentage like 5%, got {text!r}") from None
    if not 0 <= value < 1:
        raise ConfigError(f"--threshold must lie in [0%, 100%), got {text!r}")
    return value


def _cmd_record(args: argparse.Namespace) -> int:
    from autosp.experiments.history.store import record_files

    added = record_files(args.store, args.files, suite=args.suite, reference=args.ratio_to)
    print(f"recorded {added} new samples from {len(args.files)} file(s) -> {args.store}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from autosp.experiments.history.store import record_files
    from autosp.experiments.history.suites import default_out_dir, get_suite, run_suite

    suite = get_suite(args.suite)
    if args.commits:
        return _run_commits(args, suite)
    out_dir = default_out_dir(args.runs_dir, suite)
    print(f"suite {suite.name}: {suite.description}\n  results -> {out_dir}", flush=True)
    files, failed = run_suite(suite, out_dir=out_dir, autosp_cmd=args.autosp_cmd, checkout=args.checkout)
    added = record_files(args.store, files, suite=suite.name, reference=suite.reference)
    print(f"recorded {added} new samples from {len(files)} file(s) -> {args.store}")
    if failed:
        print(f"cells that failed: {', '.join(failed)}")
    return 1 if failed else 0


def _run_commits(args: argparse.Namespace, suite) -> int:
    from pathlib import Path

    from autosp.experiments.history.commits import run_commits
    from autosp.experiments.history.store import repo_root
    from autosp.harness.runner import device_name

    if args.checkout:
        raise ConfigError("give --commits or --checkout, not both: --commits makes a checkout of each commit itself")
    if suite.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"suite {suite.name!r} needs CUDA GPUs and this machine has none; use --suite cpu")
    repo = Path(args.repo).resolve() if args.repo else repo_root()
    print(f"suite {suite.name}: {suite.description}\n  commits {' '.join(args.commits)} of {repo}", flush=True)
    report = run_commits(args.commits, suite=suite, store=args.store, runs_dir=args.runs_dir,
                         autosp_cmd=args.autosp_cmd, repo=repo, device_name=device_name(suite.device))
    print(f"recorded {len(report.recorded)} commit(s) ({sum(report.recorded.values())} new samples), skipped "
          f"{len(report.skipped)} already recorded -> {args.store}")
    for sha, cells in report.failed.items():
        print(f"{sha[:9]}: cells that failed: {', '.join(cells)}")
    return 1 if report.failed else 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from autosp.experiments.history.compare import REGRESSION, compare, format_table
    from autosp.experiments.history.store import load_history

    table, info = compare(load_history(args.store), base=args.base, head=args.head,
                          threshold=parse_threshold(args.threshold), alpha=args.alpha)
    if not info["bases"]:
        why = "; ".join(info["unmeasured"]) or "no earlier recorded commit on the same machine"
        print(f"head {info['head']}: nothing to compare ({why}); other machines are never compared")
        return 0
    for machine, base in info["bases"].items():
        print(f"machine {machine}: base {base} -> head {info['head']} "
              f"(threshold {parse_threshold(args.threshold):.0%}, alpha {args.alpha})")
    if info["other_machines"]:
        print(f"not compared (other machines): {'; '.join(info['other_machines'])}")
    regressions = 0
    for kind in ("throughput", "trainability"):
        part = table[table["kind"] == kind] if not table.empty else table
        print(f"\n{kind}:\n{format_table(part)}")
        regressions += int((part["verdict"] == REGRESSION).sum()) if not part.empty else 0
    print(f"\n{regressions} regression(s)" if regressions else "\nno regression")
    return 1 if regressions else 0


def _cmd_bisect_hint(args: argparse.Namespace) -> int:
    from autosp.experiments.history.compare import bisect_hint, series_label
    from autosp.experiments.history.store import load_history

    hints = bisect_hint(load_history(args.store), threshold=parse_threshold(args.threshold), alpha=args.alpha)
    if hints.empty:
        print("no series moved between consecutive recorded commits")
        return 0
    for _, row in hints.iterrows():
        print(f"{series_label(row)} [{row['machine']}]: first moved at {row['moved_at']} "
              f"(after {row['previous']}): {row['base']:.4g} -> {row['head']:.4g} ({row['change']:+.1%}), "
              f"{row['verdict']}; bisect between them")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from autosp.experiments.history.report import draw_history, save_figure, write_dashboard
    from autosp.experiments.history.store import load_history

    history = load_history(args.store)
    threshold = parse_threshold(args.threshold)
    paths = save_figure(draw_history(history, threshold=threshold, alpha=args.alpha, base=args.base), args.out)
    page = write_dashboard(history, args.html, threshold=threshold, alpha=args.alpha, base=args.base)
    print(f"wrote {', '.join(map(str, paths))} and {page}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from autosp.experiments.history.compare import with_points
    from autosp.experiments.history.store import load_history

    df = with_points(load_history(args.store))
    listing = (df.groupby(["point", "machine"], sort=False)
               .agg(commit_time=("commit_time", "first"), hostname=("hostname", "first"),
                    samples=("metric", "size"), suites=("suite", lambda s: ",".join(sorted(set(s.dropna())))))
               .reset_index())
    print(listing.to_string(index=False))
    return 0


def add_history_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp history ...` (see the module docstring)."""
    p = subparsers.add_parser("history", help="regression history of throughput and trainability per commit")
    sub = p.add_subparsers(dest="history_command", required=True, metavar="ACTION")

    def action(name: str, help_text: str, func, **kwargs) -> argparse.ArgumentParser:
        q = sub.add_parser(name, help=help_text, **kwargs)
        q.add_argument("--store", default=DEFAULT_STORE, help="the SQLite history store")
        q.set_defaults(func=func)
        return q

    def stats_flags(q: argparse.ArgumentParser) -> None:
        q.add_argument("--threshold", default="5%", help="smallest change that counts, e.g. 5%%")
        q.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                       help="significance level of the Mann-Whitney U test (default %(default)s)")

    q = action("record", "add the samples of results files (bench/search/run JSONL) to the store", _cmd_record)
    q.add_argument("files", nargs="+", help="JSONL results files")
    q.add_argument("--suite", default=None, help="suite name stored with the samples")
    q.add_argument("--ratio-to", default=None, help="reference method of bench runs: also store speed_vs_<it>")

    from autosp.experiments.history.suites import SUITES

    q = action("run", "run a fixed suite of bench and search cells and record it", _cmd_run,
               epilog="suites: " + "; ".join(f"{s.name}: {s.description}" for s in SUITES.values()))
    q.add_argument("--suite", default="cpu", choices=list(SUITES))
    q.add_argument("--runs-dir", default="results/history/runs", help="where each run's JSONL and logs go")
    q.add_argument("--autosp-cmd", default="autosp", help="the CLI each cell calls, e.g. 'python -m autosp.cli'")
    q.add_argument("--checkout", default=None,
                   help="run the cells with the code of this checkout (e.g. a worktree of an older commit)")
    q.add_argument("--commits", nargs="+", default=None, metavar="REV",
                   help="record these commits, each with its own code in a temporary worktree: revisions and "
                        "ranges A..B (oldest first); commits already recorded for the suite on this machine are "
                        "skipped")
    q.add_argument("--repo", default=None, help="the repository --commits names (default: this checkout's)")

    q = action("compare", "compare two recorded commits per series; exit 1 on any regression", _cmd_compare,
               epilog="exit code: 0 no regression, 1 regression, 2 bad input")
    q.add_argument("--base", default=None, help="revision (default: the previous recorded commit on the machine)")
    q.add_argument("--head", default=None, help="revision (default: the latest recorded commit)")
    stats_flags(q)

    q = action("bisect-hint", "per series, the first recorded commit where it moved", _cmd_bisect_hint)
    stats_flags(q)

    q = action("plot", "figure (PNG + PDF) and a static HTML dashboard of the history", _cmd_plot)
    q.add_argument("--out", default="figures/history.png", help="PNG path; the PDF goes beside it")
    q.add_argument("--html", default="results/history/index.html", help="the dashboard page")
    q.add_argument("--base", default=None, help="revision whose median the baseline band surrounds (default: the first)")
    stats_flags(q)

    action("list", "the recorded commits per machine", _cmd_list)
