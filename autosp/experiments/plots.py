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

from autosp.experiments.tables import (  # noqa: E402
    THROUGHPUT_GROUP, TRAINABILITY_GROUP, add_records_arguments, paper_claims)
from autosp.harness.config import ConfigError  # noqa: E402

#: the paper's names for the baselines (paper_claims.csv `autosp_vs`) -> our methods that stand for them
CLAIM_BASELINE_METHODS = {
    "deepspeed-ulysses (hand-written)": ("ulysses",),
    "zero3 (FSDP)": ("zero3", "fsdp"),
    "ringattention": ("ring",),
}
OURS = "autosp"
CLAIM_STYLE = dict(color="0.85", edgecolor="0.3", hatch="//")
#: one colour per method in every figure (methods not listed take the next free colour of tab20)
METHOD_COLORS = {
    "autosp": "tab:red", "ulysses": "tab:blue", "ulysses-ac": "tab:cyan", "ulysses-compile": "tab:purple",
    "ring": "tab:green", "zero3": "tab:orange", "fsdp": "tab:brown", "ds-autosp": "tab:pink",
    "single": "tab:gray", "autosp:off": "salmon", "autosp:sac": "tab:red", "autosp:full": "darkred",
}
#: methods whose numbers depend on a compile backend: the figures name it
COMPILED_METHODS = ("autosp", "ulysses-compile", "ds-autosp")


def method_color(method: str) -> str:
    if method in METHOD_COLORS:
        return METHOD_COLORS[method]
    if method.startswith("autosp:"):
        return METHOD_COLORS["autosp"]
    palette = [c for c in plt.get_cmap("tab20").colors if c not in METHOD_COLORS.values()]
    return palette[sum(map(ord, method)) % len(palette)]
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


def _save(fig: plt.Figure, paths: str | Path | list[str | Path]) -> None:
    """Write each path (format from its suffix: .png, .pdf, ...) atomically: a workflow never sees half a file."""
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
        fig.savefig(tmp, dpi=150, bbox_inches="tight")
        tmp.replace(path)
    plt.close(fig)


def _short(text: object, width: int = 38) -> str:
    """A failure reason short enough to sit under a bar."""
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


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
    elif pd.notna(row.get("achieved_over_limit")):
        label += f"\n{row['achieved_over_limit']:.0%}"
    return label


def _method_legend_label(method: str, sub: pd.DataFrame) -> str:
    """The method with the ZeRO stage(s) it ran, and for compiled methods the backend its numbers were measured
    with."""
    stages = sorted({int(z) for z in sub.get("zero", pd.Series(dtype=object)).dropna()})
    name = f"{method} ZeRO-{'/'.join(map(str, stages))}" if stages else method
    if method in COMPILED_METHODS:
        backends = ", ".join(sorted({str(b) for b in sub.get("compile_backend", pd.Series(dtype=object)).dropna()}))
        if method == "ds-autosp":
            backends = "inductor (DeepSpeed's own)"
        if backends:
            return f"{name} [{backends}]"
    return name


def _device_panels(table: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One panel per device type: the device name the records report (a GPU model, a CPU, a simulated device)."""
    name = table["device_name"] if "device_name" in table else pd.Series(None, index=table.index, dtype=object)
    device = name.fillna(table["device"].astype(str)) if "device" in table else name.fillna("device")
    return [(str(d), sub) for d, sub in table.assign(_device=device).groupby("_device", sort=True)]


def _trainability_panel(ax: plt.Axes, device: str, sub: pd.DataFrame) -> None:
    """Max length per (model, method) on a log2 axis: measured bars solid, simulated hatched outlines, failed
    cells a crossed stub with the reason, the analytic floor limit a dashed tick, gradient checks beside."""
    models = list(dict.fromkeys(sub.sort_values(["world_size", "model"])["model"]))
    methods = list(dict.fromkeys(sub.sort_values("max_seq_len", ascending=False, na_position="last")["method"]))
    width = 0.8 / max(len(methods), 1)
    lengths = pd.to_numeric(sub["max_seq_len"], errors="coerce").dropna()
    floor_y = 2 ** math.floor(math.log2(lengths.min() / 4)) if len(lengths) else 256
    handles: dict[str, object] = {}
    for i, model in enumerate(models):
        for j, method in enumerate(methods):
            cell = sub[(sub["model"] == model) & (sub["method"] == method)]
            if cell.empty:
                continue
            row = cell.iloc[0]
            x = i - 0.4 + width * (j + 0.5)
            color = method_color(method)
            simulated = row.get("mode") == "simulated"
            if pd.isna(row["max_seq_len"]):  # failed or nothing fit: drawn as such, with the reason
                ax.bar(x, floor_y, width * 0.9, bottom=floor_y / 2, facecolor="white", edgecolor=color, hatch="xx")
                reason = row.get("error") if isinstance(row.get("error"), str) else _bar_label(row)
                ax.annotate(_short(f"{method} {row['status']}: {reason}", 48), (x, floor_y * 1.6), rotation=90,
                            ha="center", va="bottom", fontsize=5, color="0.2")
            else:
                style = (dict(facecolor="none", edgecolor=color, hatch="..", linewidth=1.2) if simulated
                         else dict(color=color))
                bar = ax.bar(x, float(row["max_seq_len"]), width * 0.9, **style)
                label = _method_legend_label(method, sub[sub["method"] == method])
                handles.setdefault(label + (" (simulated)" if simulated else ""), bar)
                ax.annotate(_bar_label(row), (x, float(row["max_seq_len"])), ha="center", va="bottom", fontsize=5)
            limit = row.get("floor_limit_seq_len")
            if pd.notna(limit):
                ax.hlines(float(limit), x - width / 2, x + width / 2, colors="k", linestyles="--", linewidth=0.8)
            check = row.get("gradient_check")
            if isinstance(check, str):
                ax.annotate(_short("grad check " + check, 44), (x, floor_y / 2), rotation=90, ha="center",
                            va="bottom", fontsize=5, color="darkred" if "FAILED" in check else "darkgreen")
    ticks = []
    for model in models:
        first = sub[sub["model"] == model].iloc[0]
        budget = first.get("memory_budget")
        ticks.append(f"{model}\nP={first['world_size']}"
                     + (f", {budget / 2**20:.0f} MiB" if pd.notna(budget) else ", device memory"))
    ax.set_xticks(range(len(models)), ticks, fontsize=7)
    ax.set_yscale("log", base=2)
    ax.set_ylabel("max trainable sequence length (tokens, log2)")
    ax.set_title(f"{device}\n(dashed: analytic memory-floor limit; % = measured / limit)", fontsize=8)
    ax.legend(list(handles.values()), list(handles), fontsize=6, loc="upper right")
    ax.set_ylim(bottom=floor_y / 2, top=ax.get_ylim()[1] * 4)


def trainability_figure(table: pd.DataFrame, path: str | Path | list[str | Path],
                        claims: pd.DataFrame | None = None) -> None:
    """One panel per device type (max trainable length per model and method), one of AutoSP's ratios vs claims."""
    claims = paper_claims() if claims is None else claims
    panels = _device_panels(table)
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(7 * len(panels) + 5, 5), squeeze=False,
                             layout="constrained")
    for ax, (device, sub) in zip(axes[0], panels):
        _trainability_panel(ax, device, sub)
    ax = axes[0][-1]
    bars = _trainability_claim_rows(table, claims)
    for i, (label, factor, kind) in enumerate(bars):
        style = {"claim": CLAIM_STYLE, "simulated": SIMULATED_STYLE}.get(kind, dict(color=method_color(OURS)))
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


def _failed_runs(records: pd.DataFrame | None) -> pd.DataFrame:
    if records is None or records.empty or "status" not in records:
        return pd.DataFrame(columns=["model", "method", "seq_len", "status", "error"])
    runs = records[(records["status"] != "ok")]
    if "kind" in runs:
        runs = runs[runs["kind"].isna()]
    return runs


def throughput_figure(table: pd.DataFrame, path: str | Path | list[str | Path], claims: pd.DataFrame | None = None,
                      reference: str = "ulysses", records: pd.DataFrame | None = None) -> None:
    """Per setting: iteration time, tokens/s (spread over repeats as error bars) and the speed ratio to
    `reference` vs sequence length (log2), the paper's claim hatched; runs that failed are marked with why."""
    claims = paper_claims() if claims is None else claims
    group = [c for c in THROUGHPUT_GROUP if c != "seq_len"]
    settings = list(table.groupby(group, dropna=False))
    failed = _failed_runs(records)
    fig, axes = plt.subplots(3, len(settings), figsize=(5.5 * len(settings), 10), squeeze=False,
                             layout="constrained")
    claim = claims[(claims["metric"] == "iteration_speed_ratio")
                   & claims["autosp_vs"].map(lambda name: reference in CLAIM_BASELINE_METHODS.get(name, ()))]
    ratio_col = f"speed_vs_{reference}"
    for col, (key, sub) in enumerate(settings):
        top, mid, bottom = axes[0][col], axes[1][col], axes[2][col]
        for method, m in sub.groupby("method"):
            m = m.sort_values("seq_len")
            color = method_color(method)
            label = _method_legend_label(method, m)
            t = m["iter_time_s"]
            top.errorbar(m["seq_len"], t, yerr=[t - m["iter_time_min_s"], m["iter_time_max_s"] - t], marker="o",
                         capsize=3, color=color, label=label)
            tps = m["tokens_per_s"]  # tokens per step are fixed, so tokens/s scales as 1 / step time
            err = [tps - tps * t / m["iter_time_max_s"], tps * t / m["iter_time_min_s"] - tps]
            mid.errorbar(m["seq_len"], tps, yerr=err, marker="o", capsize=3, color=color, label=label)
            if ratio_col in m and method != reference:
                bottom.plot(m["seq_len"], m[ratio_col], marker="o", color=color, label=f"{method} (measured)")
        model = dict(zip(group, key if isinstance(key, tuple) else (key,))).get("model")
        for _, run in failed[failed["model"] == model].drop_duplicates(["method", "seq_len"]).iterrows():
            top.plot(run["seq_len"], top.get_ylim()[0] if top.has_data() else 1, marker="x", ms=9,
                     color=method_color(run["method"]))
            top.annotate(_short(f"{run['method']}: {run['status']} ({run['error']})"), (run["seq_len"], 0.02),
                         xycoords=("data", "axes fraction"), rotation=90, fontsize=5, va="bottom")
        for _, c in claim.iterrows():
            bottom.axhspan(float(c["factor"]) - 0.01, float(c["factor"]) + 0.01, **CLAIM_STYLE,
                           label=f"paper claim: {c['factor']:.2f} ({c['hardware']})")
        bottom.axhline(1.0, color="k", lw=0.8)
        top.set_title(_panel_title(key if isinstance(key, tuple) else (key,), group), fontsize=9)
        for ax, ylabel in ((top, "iteration time (s)"), (mid, "tokens/s"), (bottom, f"iteration speed / {reference}")):
            ax.set_xscale("log", base=2)
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=6)
        top.set_yscale("log", base=2)
        bottom.set_xlabel("sequence length (tokens, log2)")
    _save(fig, path)


def memory_figure(table: pd.DataFrame, path: str | Path | list[str | Path], baseline: str,
                  claims: pd.DataFrame | None = None) -> None:
    """Saved-for-backward bytes per rank by operator category per method, and the attention and MLP
    reductions against `baseline` beside the paper's claims (hatched)."""
    from autosp.experiments.activations import CATEGORIES

    claims = paper_claims() if claims is None else claims
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    categories = [*CATEGORIES, "total"]
    ok = table[table["status"] == "ok"]
    width = 0.8 / max(len(table), 1)
    for j, (_, row) in enumerate(table.iterrows()):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(categories))]
        if row["status"] != "ok":
            left.annotate(_short(f"{row['method']}: {row['status']} ({row['error']})", 60), (0.01, 0.95 - 0.05 * j),
                          xycoords="axes fraction", fontsize=6, color=method_color(row["method"]))
            continue
        mib = [float(row.get(f"{c}_bytes") or 0) / 2**20 for c in categories]
        left.bar(xs, mib, width * 0.9, color=method_color(row["method"]), label=row["method"])
    left.set_xticks(range(len(categories)), categories)
    left.set_ylabel("saved for backward per rank (MiB)")
    first = table.iloc[0]
    left.set_title(f"activation memory by operator · {first['model']} · S={first['seq_len']}", fontsize=9)
    left.legend(fontsize=7)
    bars: list[tuple[str, float, object]] = []
    for metric_category in ("attention", "mlp"):
        for _, row in ok[ok["method"] != baseline].iterrows():
            factor = row.get(f"{metric_category}_reduction")
            if pd.notna(factor) and math.isfinite(factor):
                bars.append((f"{metric_category}: {row['method']} vs {baseline}", float(factor),
                             dict(color=method_color(row["method"]))))
            elif pd.notna(factor):
                bars.append((f"{metric_category}: {row['method']} saves none", 0.0, dict(color="white")))
        claim_id = f"activation_mem_{metric_category}"
        for _, c in claims[claims["claim_id"] == claim_id].iterrows():
            bars.append((f"{metric_category}: paper claim ({c['hardware']})", float(c["factor"]), CLAIM_STYLE))
    for i, (label, factor, style) in enumerate(bars):
        right.barh(i, factor, **style)
        right.annotate(f"{factor:.2f}×" if factor else "all recomputed", (factor, i), va="center", fontsize=7)
    right.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    right.invert_yaxis()
    right.axvline(1.0, color="k", lw=0.8)
    right.set_xlabel(f"reduction: {baseline} bytes / method bytes")
    right.set_title("measured here (method colours) vs paper claims (hatched)", fontsize=9)
    _save(fig, path)


def sac_figure(table: pd.DataFrame, path: str | Path | list[str | Path], claims: pd.DataFrame | None = None) -> None:
    """SAC's price and payoff per policy: step-time overhead vs max-length gain, both against policy `off`,
    with the paper's ~7% / 1.66x (hatched box); policies whose search or bench failed are listed with why."""
    claims = paper_claims() if claims is None else claims
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    markers = dict(zip(table["policy"], "osD^vP*X"))
    for _, row in table.iterrows():
        gain, overhead = row.get("length_gain"), row.get("time_overhead")
        if pd.notna(gain) and pd.notna(overhead):
            left.scatter(100 * overhead, gain, s=60, marker=markers[row["policy"]], color=method_color(OURS),
                         label=f"autosp sac={row['policy']} (measured)")
            left.annotate(f" {row['policy']}", (100 * overhead, gain), fontsize=7)
        else:
            left.annotate(_short(f"sac={row['policy']}: search {row['search_status']}, time "
                                 f"{'missing' if pd.isna(row['iter_time_s']) else 'ok'}", 60),
                          (0.02, 0.95 - 0.05 * list(table["policy"]).index(row["policy"])),
                          xycoords="axes fraction", fontsize=6)
    overhead_claim = claims[claims["claim_id"] == "sac_overhead"]["factor"]
    gain_claim = claims[claims["claim_id"] == "sac_trainability"]["factor"]
    if len(overhead_claim) and len(gain_claim):
        x, y = 100 * float(overhead_claim.iloc[0]), float(gain_claim.iloc[0])
        left.add_patch(plt.Rectangle((x - 2, y - 0.05), 4, 0.1, **CLAIM_STYLE))
        left.annotate(f"paper claim: ~{x:.0f}% / {y:.2f}× (NVIDIA)", (x + 2.5, y), fontsize=7, va="center")
    left.axhline(1.0, color="k", lw=0.8)
    left.axvline(0.0, color="k", lw=0.8)
    left.set_xlabel("step-time overhead vs sac=off (%)")
    left.set_ylabel("max trainable length / sac=off")
    left.set_title("SAC: time cost vs length gain per policy", fontsize=9)
    left.legend(fontsize=7, loc="lower right")
    left.autoscale_view()
    xs = range(len(table))
    right.bar(xs, pd.to_numeric(table["max_seq_len"], errors="coerce").fillna(0), color=method_color(OURS),
              alpha=0.8)
    right.set_xticks(list(xs), [f"sac={p}" for p in table["policy"]])
    right.set_yscale("log", base=2)
    right.set_ylabel("max trainable length (tokens, log2)")
    for x, (_, row) in zip(xs, table.iterrows()):
        if pd.notna(row["iter_time_s"]):
            right.annotate(f"{row['iter_time_s'] * 1e3:.0f} ms/step\nat S={int(row['seq_len'])}",
                           (x, max(float(row["max_seq_len"]) if pd.notna(row["max_seq_len"]) else 1, 1)),
                           ha="center", va="bottom", fontsize=6)
    model = table["model"].dropna().iloc[0] if table["model"].notna().any() else ""
    right.set_title(f"autosp per SAC policy · {model}", fontsize=9)
    _save(fig, path)


def check_figure_path(path: str | Path) -> None:
    """ConfigError unless matplotlib can write a figure of this file type at `path` (checked before any work)."""
    from autosp.harness.records import check_writable

    kinds = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix not in kinds:
        raise ConfigError(f"--out {path}: cannot write a figure as {suffix or 'a file without a suffix'!r}; use one "
                          f"of .{', .'.join(sorted(kinds))}")
    check_writable(path)


def _cmd_plot(args: argparse.Namespace) -> int:
    from autosp.experiments.tables import (load_checks, memory_table, records_from_args, sac_table, throughput_table,
                                           trainability_table)

    for path in args.out:
        check_figure_path(path)
    records = records_from_args(args)
    if args.kind == "trainability":
        trainability_figure(trainability_table(records, checks=load_checks(args.checks) if args.checks else None),
                            args.out)
    elif args.kind == "memory":
        memory_figure(memory_table(records, baseline=args.baseline), args.out, baseline=args.baseline)
    elif args.kind == "sac":
        sac_figure(sac_table(records), args.out)
    else:
        throughput_figure(throughput_table(records, reference=args.ratio_to), args.out, reference=args.ratio_to,
                          records=records)
    print(f"wrote {' '.join(args.out)}")
    return 0


def add_plot_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp plot trainability|throughput|memory|sac --in FILES... --out figure.png [figure.pdf]`."""
    p = subparsers.add_parser("plot", help="paper-style figures (with the paper's claims) from result records")
    p.add_argument("kind", choices=["trainability", "throughput", "memory", "sac"])
    add_records_arguments(p)
    p.add_argument("--out", nargs="+", required=True, help="figure files, format by suffix (.png, .pdf)")
    p.add_argument("--ratio-to", default="ulysses", help="throughput: reference method")
    p.add_argument("--checks", nargs="*", default=[], help="trainability: `autosp check --json-out` reports")
    p.add_argument("--baseline", default="single", help="memory: the method reductions are taken against")
    p.set_defaults(func=_cmd_plot)
