"""Paper-style figures from the result tables, with the paper's claims drawn beside our measurements.

Claims come from `autosp.experiments.tables.paper_claims()` and are always drawn hatched and labelled "paper claim"
with their hardware, so a reader never mistakes them for something this project measured.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on clusters or CI
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from autosp.experiments.tables import THROUGHPUT_GROUP, TRAINABILITY_GROUP, paper_claims  # noqa: E402

#: the paper's names for the baselines (paper_claims.csv `autosp_vs`) -> our methods that stand for them
CLAIM_BASELINE_METHODS = {
    "deepspeed-ulysses (hand-written)": ("ulysses",),
    "zero3 (FSDP)": ("zero3", "fsdp"),
    "ringattention": ("ring",),
}
OURS = "autosp"
CLAIM_STYLE = dict(color="0.85", edgecolor="0.3", hatch="//")
#: simulated cells (`mode: simulated`, autosp simulate) are outlined and cross-hatched, never solid
SIMULATED_STYLE = dict(fill=False, edgecolor="tab:red", hatch="xx")


def _panel_title(key: tuple, names: list[str]) -> str:
    parts = dict(zip(names, key))
    text = f"{parts.get('model')} · P={parts.get('world_size')} · {parts.get('device')}"
    budget = parts.get("memory_budget")
    if budget is not None and not (isinstance(budget, float) and math.isnan(budget)):
        text += f" · budget {budget / 2**20:.0f} MiB"
    if "seq_len" in parts:
        text += f" · S={parts['seq_len']}"
    return text


def _save(fig: plt.Figure, path: str | Path) -> None:
    """Write atomically: a workflow never sees half a PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=150, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)


def _trainability_claim_rows(table: pd.DataFrame, claims: pd.DataFrame) -> list[tuple[str, float, str]]:
    """(label, factor, kind) bars: measured AutoSP/baseline ratios per setting, then the paper's claims."""
    bars: list[tuple[str, float, str]] = []
    group = [c for c in TRAINABILITY_GROUP if c in table]
    for paper_name, methods in CLAIM_BASELINE_METHODS.items():
        for baseline in methods:
            for key, sub in table.groupby(group, dropna=False):
                ours = sub.loc[sub["method"] == OURS, "max_seq_len"].dropna()
                base = sub.loc[sub["method"] == baseline, "max_seq_len"].dropna()
                if len(ours) and len(base) and base.iloc[0] > 0:
                    mode = _mode(dict(zip(group, key)))
                    bars.append((f"vs {baseline}\n{key[0]} ({mode})", float(ours.iloc[0] / base.iloc[0]), mode))
        rows = claims[(claims["metric"] == "max_trainable_seq_len_ratio") & (claims["autosp_vs"] == paper_name)]
        for _, claim in rows.iterrows():
            bars.append((f"vs {paper_name}\npaper claim, {claim['hardware']}", float(claim["factor"]), "claim"))
    return bars


def _mode(parts: dict) -> str:
    """measured or simulated (records from before the `mode` column are measured)."""
    mode = parts.get("mode")
    return mode if isinstance(mode, str) else "measured"


def _bar_label(row: pd.Series) -> str:
    """Length and % of the floor limit; a search that found no length says why."""
    if pd.isna(row["max_seq_len"]):
        return {"oom_at_min_len": "OOM at\nmin len"}.get(row["status"], row["status"])
    label = ("≥" if row["status"] == "no_oom_up_to_max_len" else "") + str(int(row["max_seq_len"]))
    if row["status"] in ("error", "timeout"):
        label += f"\n({row['status']})"
    elif pd.notna(row["achieved_over_limit"]):
        label += f"\n{row['achieved_over_limit']:.0%}"
    return label


def trainability_figure(table: pd.DataFrame, path: str | Path, claims: pd.DataFrame | None = None) -> None:
    """One panel of max trainable length per setting (floor limit marked), one of AutoSP's ratios vs claims."""
    claims = paper_claims() if claims is None else claims
    group = [c for c in TRAINABILITY_GROUP if c in table]
    settings = list(table.groupby(group, dropna=False))
    fig, axes = plt.subplots(1, len(settings) + 1, figsize=(4.5 * (len(settings) + 1), 4.2), squeeze=False,
                             layout="constrained")
    for ax, (key, sub) in zip(axes[0], settings):
        sub = sub.sort_values("max_seq_len", ascending=False, na_position="last")
        x = range(len(sub))
        heights = sub["max_seq_len"].fillna(0).to_numpy()
        colors = ["tab:red" if m == OURS else "tab:blue" for m in sub["method"]]
        ax.bar(x, sub["floor_limit_seq_len"].astype(float).fillna(0).to_numpy(), fill=False, edgecolor="k",
               ls="--", label="memory-floor limit (analytic; % = measured / limit)")
        if _mode(dict(zip(group, key if isinstance(key, tuple) else (key,)))) == "simulated":
            ax.bar(x, heights, fill=False, edgecolor=colors, hatch="xx", label="simulated max length (autosp simulate)")
        else:
            ax.bar(x, heights, color=colors, label="measured max length")
        for xi, (_, row) in zip(x, sub.iterrows()):
            ax.annotate(_bar_label(row), (xi, heights[xi]), ha="center", va="bottom", fontsize=6)
        ax.set_xticks(list(x), sub["method"], rotation=40, ha="right")
        ax.set_ylabel("max trainable sequence length (tokens)")
        ax.set_title(_panel_title(key if isinstance(key, tuple) else (key,), group), fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        ax.set_ylim(top=ax.get_ylim()[1] * 1.15)  # room for the legend above the tallest bar
    ax = axes[0][-1]
    bars = _trainability_claim_rows(table, claims)
    for i, (label, factor, kind) in enumerate(bars):
        style = {"claim": CLAIM_STYLE, "simulated": SIMULATED_STYLE}.get(kind, dict(color="tab:red"))
        ax.barh(i, factor, **style)
        ax.annotate(f"{factor:.2f}×", (factor, i), va="center", fontsize=7)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("AutoSP max length / baseline max length")
    ax.set_title("AutoSP trainability ratio: measured here (red), simulated (outlined, xx)\n"
                 "vs paper claims (hatched //; GPUs, Llama up to 8B)",
                 fontsize=9)
    _save(fig, path)


def throughput_figure(table: pd.DataFrame, path: str | Path, claims: pd.DataFrame | None = None,
                      reference: str = "ulysses") -> None:
    """Tokens/s vs length per method (spread over repeats as error bars) and AutoSP's speed vs the claim."""
    claims = paper_claims() if claims is None else claims
    group = [c for c in THROUGHPUT_GROUP if c != "seq_len"]
    settings = list(table.groupby(group, dropna=False))
    fig, axes = plt.subplots(2, len(settings), figsize=(5 * len(settings), 7), squeeze=False,
                             layout="constrained")
    claim = claims[(claims["metric"] == "iteration_speed_ratio")
                   & claims["autosp_vs"].map(lambda name: reference in CLAIM_BASELINE_METHODS.get(name, ()))]
    ratio_col = f"speed_vs_{reference}"
    for col, (key, sub) in enumerate(settings):
        top, bottom = axes[0][col], axes[1][col]
        for method, m in sub.groupby("method"):
            m = m.sort_values("seq_len")
            tps = m["tokens_per_s"]  # tokens per step are fixed, so tokens/s scales as 1 / step time
            err = [tps - tps * m["iter_time_s"] / m["iter_time_max_s"],
                   tps * m["iter_time_s"] / m["iter_time_min_s"] - tps]
            top.errorbar(m["seq_len"], m["tokens_per_s"], yerr=err, marker="o", capsize=3, label=method)
            if ratio_col in m and method != reference:
                bottom.plot(m["seq_len"], m[ratio_col], marker="o", label=f"{method} (measured)")
        for _, c in claim.iterrows():
            bottom.axhline(float(c["factor"]), color="0.4", ls="--",
                           label=f"paper claim: {c['factor']:.2f} ({c['hardware']})")
        bottom.axhline(1.0, color="k", lw=0.8)
        title = _panel_title(key if isinstance(key, tuple) else (key,), group)
        top.set_title(title, fontsize=9)
        top.set_xscale("log", base=2)
        top.set_ylabel("tokens/s")
        top.legend(fontsize=7)
        bottom.set_xscale("log", base=2)
        bottom.set_xlabel("sequence length (tokens)")
        bottom.set_ylabel(f"iteration speed / {reference}")
        bottom.legend(fontsize=7)
    _save(fig, path)


def _cmd_plot(args: argparse.Namespace) -> int:
    from autosp.harness.records import load_records
    from autosp.experiments.tables import throughput_table, trainability_table

    records = load_records(args.inputs)
    if args.kind == "trainability":
        trainability_figure(trainability_table(records), args.out)
    else:
        throughput_figure(throughput_table(records, reference=args.ratio_to), args.out, reference=args.ratio_to)
    print(f"wrote {args.out}")
    return 0


def add_plot_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp plot trainability|throughput --in FILES... --out figure.png`."""
    p = subparsers.add_parser("plot", help="paper-style figures (with the paper's claims) from result records")
    p.add_argument("kind", choices=["trainability", "throughput"])
    p.add_argument("--in", dest="inputs", nargs="+", required=True, help="JSONL record files")
    p.add_argument("--out", required=True, help="figure file (.png or .pdf)")
    p.add_argument("--ratio-to", default="ulysses", help="throughput: reference method")
    p.set_defaults(func=_cmd_plot)
