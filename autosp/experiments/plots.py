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
import matplotlib.colors  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from autosp.experiments.tables import (  # noqa: E402
    COMPILED_METHODS,
    SAME_SHAPES,
    THROUGHPUT_GROUP,
    TRAINABILITY_GROUP,
    add_records_arguments,
    model_order,
    paper_claims,
    peers_published,
)
from autosp.harness.config import ConfigError  # noqa: E402

#: the paper's names for the baselines (paper_claims.csv `autosp_vs`) -> our methods that stand for them
CLAIM_BASELINE_METHODS = {
    "deepspeed-ulysses (hand-written)": ("ulysses",),
    "zero3 (FSDP)": ("zero3", "fsdp"),
    "ringattention": ("ring",),
}
OURS = "autosp"
CLAIM_STYLE = dict(facecolor="0.85", edgecolor="0.3", hatch="//")
#: one colour per method in every figure (methods not listed take the next free colour of tab20)
METHOD_COLORS = {
    "autosp": "tab:red", "ulysses": "tab:blue", "ulysses-compile": "tab:purple",
    "ring": "tab:green", "zero3": "tab:orange", "fsdp": "tab:brown", "ds-autosp": "tab:pink",
    "single": "tab:gray", "autosp:off": "salmon", "autosp:sac": "tab:red", "autosp:full": "darkred",
    "alst": "tab:olive",
}
#: a trainability panel writes each bar's length on it up to this many bars; beyond, the axis and the ratio grid
#: carry the numbers (labels of more bars would overlap at the size a figure is shown)
MAX_LABELLED_BARS = 24
#: the analytic floor's limit is drawn on a bar only within this factor of it: further off it says nothing
FLOOR_SHOWN_WITHIN = 4.0
#: the order of methods in bars, legends and the ratio grid
SERIES_ORDER = ("autosp", "autosp[paper]", "ds-autosp", "alst", "ulysses", "ring", "fsdp", "zero3")
FAILED_HANDLE = Patch(facecolor="white", edgecolor="0.3", hatch="xx")
FLOOR_HANDLE = Line2D([], [], color="k", linestyle="--", linewidth=0.8)


def method_color(method: str) -> str | tuple:
    """The method's colour; a variant (`ulysses[ac=layer]`) is its method's colour, darker."""
    if method in METHOD_COLORS:
        return METHOD_COLORS[method]
    if method.startswith("autosp:"):
        return METHOD_COLORS["autosp"]
    if "[" in method:
        return tuple(0.55 * c for c in matplotlib.colors.to_rgb(method_color(method.split("[", 1)[0])))
    used = {matplotlib.colors.to_rgb(c) for c in METHOD_COLORS.values()}
    palette = [c for c in plt.get_cmap("tab20").colors if c not in used]
    return palette[sum(map(ord, method)) % len(palette)]


def _panel_title(key: tuple, names: list[str]) -> str:
    parts = dict(zip(names, key, strict=True))
    text = f"{parts.get('model')} · P={parts.get('world_size')} · {parts.get('device')}"
    budget = parts.get("memory_budget")
    if budget is not None and not (isinstance(budget, float) and math.isnan(budget)):
        text += f" · budget {budget / 2**20:.0f} MiB"
    if "seq_len" in parts:
        text += f" · S={parts['seq_len']}"
    return text


def save_figure(fig: plt.Figure, paths: str | Path | list[str | Path]) -> None:
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


def _mode(parts: dict) -> str:
    """measured or simulated (records from before the `mode` column are measured)."""
    mode = parts.get("mode")
    return mode if isinstance(mode, str) else "measured"


def _method_legend_label(method: str, sub: pd.DataFrame) -> str:
    """The method with the ZeRO stage(s) it ran, and for compiled methods the backend its numbers were measured
    with."""
    stages = sorted({int(z) for z in sub.get("zero", pd.Series(dtype=object)).dropna()})
    name = f"{method} ZeRO-{'/'.join(map(str, stages))}" if stages else method
    if method in COMPILED_METHODS:
        backends = ", ".join(sorted({str(b) for b in sub.get("compile_backend", pd.Series(dtype=object)).dropna()}))
        if method == "ds-autosp" and backends:
            backends = "inductor (DeepSpeed's own)"
        if backends:
            return f"{name} [{backends}]"
    return name


def _device_panels(table: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One panel per device type: the device name the records report (a GPU model, a CPU, a simulated device)."""
    name = table["device_name"] if "device_name" in table else pd.Series(None, index=table.index, dtype=object)
    device = name.fillna(table["device"].astype(str)) if "device" in table else name.fillna("device")
    return [(str(d), sub) for d, sub in table.assign(_device=device).groupby("_device", sort=True)]


def _stage(row: pd.Series) -> int | None:
    zero = row.get("zero")
    return None if zero is None or pd.isna(zero) else int(zero)


def _length(row: pd.Series) -> float:
    """The cell's max trainable length, or NaN where none fits or the search failed."""
    n = pd.to_numeric(pd.Series([row.get("max_seq_len")]), errors="coerce").iloc[0]
    return float(n) if pd.notna(n) and n > 0 else float("nan")


def _series(table: pd.DataFrame) -> list[tuple[str, int | None]]:
    """(method, ZeRO stage) per bar series: AutoSP first, then the peers and baselines in SERIES_ORDER, a
    method's higher stage first."""
    keys = {(row["method"], _stage(row)) for _, row in table.iterrows()}
    rank = {m: i for i, m in enumerate(SERIES_ORDER)}
    return sorted(keys, key=lambda k: (rank.get(k[0], len(rank)), k[0], -_key(k[1])))


def _multi_stage(table: pd.DataFrame) -> set[str]:
    """Methods that ran at more than one ZeRO stage in this table: their labels and shades name the stage."""
    if "zero" not in table:
        return set()
    stages = table.dropna(subset=["zero"]).groupby("method")["zero"].nunique()
    return set(stages[stages > 1].index)


def _series_label(method: str, stage: int | None, table: pd.DataFrame, multi: set[str]) -> str:
    rows = table[table["method"] == method]
    if method in multi and stage is not None:
        rows = rows[rows["zero"] == stage]
    return _method_legend_label(method, rows)


def _series_color(method: str, stage: int | None, multi: set[str]) -> tuple:
    """The method's colour; a lower ZeRO stage of a method that ran several is the same colour, lighter."""
    rgb = matplotlib.colors.to_rgb(method_color(method))
    if method in multi and stage is not None and stage < 3:
        return tuple(0.45 * c + 0.55 for c in rgb)
    return rgb


def token_label(value: float, _pos: object = None) -> str:
    """An axis tick in tokens: 4K, 64K, 1M."""
    if value >= 2**20:
        return f"{value / 2**20:g}M"
    return f"{value / 1024:g}K" if value >= 1024 else f"{value:g}"


def _check_line(method: str, check: object) -> str:
    """A gradient check verdict in a few words: `autosp: PASSED 9.7e-06`."""
    text = str(check)
    words = text.split()
    worst = next((w.rstrip(",") for w in words if "e-" in w or "e+" in w), "")
    return f"{method}: {words[0] if words else text} {worst}".strip()


def _model_tick(model: str, cells: pd.DataFrame) -> str:
    first = cells.iloc[0]
    budget = first.get("memory_budget")
    lines = [model, f"P={first['world_size']}, " + (f"{budget / 2**20:.0f} MiB" if pd.notna(budget)
                                                     else "device memory")]
    if "gradient_check" in cells:
        lines += [_check_line(r["method"], r["gradient_check"]) for _, r in cells.iterrows()
                  if isinstance(r["gradient_check"], str)]
    return "\n".join(lines)


#: the published peers' markers (`autosp table peers`), in every figure that draws them
PEER_MARKERS = {"alst": "*", "upipe": "D"}


def panel_anchors(published: pd.DataFrame, device: str, model: str, world_size: object) -> pd.DataFrame:
    """The published peers' longest lengths (`tables.peers_published`) measured on `device` with `world_size` GPUs,
    on `model` or a model of the same shapes (UPipe's Llama-3-8B for Llama-3.1-8B); a throughput anchor
    (torchtitan's: a length it ran at, not its longest) is none."""
    base = str(model).rpartition(":")[2]
    return published[(published["device"] == device) & (published["world_size"] == world_size)
                     & published["model"].isin((base, *SAME_SHAPES.get(base, ())))
                     & published["seq_len"].notna() & published["tokens_per_s_per_gpu"].isna()]


def _trainability_panel(ax: plt.Axes, device: str, sub: pd.DataFrame, series: list[tuple[str, int | None]],
                        multi: set[str], handles: dict[str, object], published: pd.DataFrame) -> None:
    """Max length per model (groups) and method (bars) on a log2 axis: measured bars solid, simulated ones hatched,
    cells where nothing trains a crossed stub. Lengths and failure reasons are written on the bars when the panel
    has few enough of them to stay readable; the analytic floor's limit is drawn only where it lies within
    FLOOR_SHOWN_WITHIN of the bar (further off it says nothing about the bar). A published peer's length on this
    device type, model and GPU count (`panel_anchors`) is a black marker over the model's bars, never a bar."""
    models = sorted(dict.fromkeys(sub["model"]), key=model_order)
    stages = _stages(sub)
    # per model the series that ran on it, centred on its tick: no gaps for methods another model ran
    groups = [[s for s in series if ((sub["model"] == m) & (sub["method"] == s[0]) & (stages == _key(s[1]))).any()]
              for m in models]
    width = 0.8 / max(max(map(len, groups), default=1), 1)
    lengths = pd.Series([_length(r) for _, r in sub.iterrows()]).dropna()
    floor_y = 2 ** math.floor(math.log2(lengths.min() / 4)) if len(lengths) else 256
    labelled = len(sub) <= MAX_LABELLED_BARS
    floor_drawn = 0.0  # the highest floor limit drawn (0: none)
    for i, (model, group) in enumerate(zip(models, groups, strict=True)):
        for j, (method, stage) in enumerate(group):
            row = sub[(sub["model"] == model) & (sub["method"] == method) & (stages == _key(stage))].iloc[0]
            x = i + width * (j - (len(group) - 1) / 2)
            color = _series_color(method, stage, multi)
            length = _length(row)
            if math.isnan(length):  # nothing trains, or the search failed: a crossed stub, the reason written on it
                ax.bar(x, floor_y / 2, width * 0.9, bottom=floor_y / 2, facecolor="white", edgecolor=color,
                       hatch="xx")
                handles.setdefault("no length trains (OOM at the minimum) or failed", FAILED_HANDLE)
                if labelled:
                    reason = row.get("error") if isinstance(row.get("error"), str) else row["status"]
                    ax.annotate(_short(f"{method} {row['status']}: {reason}" if reason != row["status"]
                                       else f"{method}: {reason}", 90),
                                (x, floor_y * 1.05), rotation=90, ha="center", va="bottom", fontsize=5, color="0.2")
                continue
            simulated = row.get("mode") == "simulated"
            style = (dict(facecolor=color, edgecolor="white", hatch="///", linewidth=0) if simulated
                     else dict(color=color))
            bar = ax.bar(x, length, width * 0.9, **style)
            label = _series_label(method, stage, sub, multi) + (" (simulated)" if simulated else "")
            handles.setdefault(label, bar)
            if labelled:  # inside the bar's top: the floor's dash above it never crosses the number
                prefix = "≥" if row["status"] == "no_oom_up_to_max_len" else ""
                ax.annotate(f"{prefix}{int(length):,}", (x, length), rotation=90, ha="center", va="top",
                            fontsize=6, xytext=(0, -3), textcoords="offset points", color="white")
            limit = pd.to_numeric(pd.Series([row.get("floor_limit_seq_len")]), errors="coerce").iloc[0]
            if pd.notna(limit) and limit <= FLOOR_SHOWN_WITHIN * length:
                ax.hlines(float(limit), x - width / 2, x + width / 2, colors="k", linestyles="--", linewidth=0.8)
                floor_drawn = max(floor_drawn, float(limit))
    marked = 0.0  # the longest published length drawn (0: none)
    for i, model in enumerate(models):
        for _, anchor in panel_anchors(published, device, model, sub[sub["model"] == model]["world_size"].iloc[0]
                                       ).iterrows():
            marker = PEER_MARKERS.get(anchor["peer"], "o")
            ax.plot(i, anchor["seq_len"], marker, color="k", markersize=8)
            handles.setdefault(f"{anchor['peer']} (published, {int(anchor['world_size'])} GPUs)",
                               Line2D([], [], marker=marker, color="k", linestyle=""))
            marked = max(marked, float(anchor["seq_len"]))
    if floor_drawn:
        handles.setdefault(f"analytic memory-floor limit (drawn within {FLOOR_SHOWN_WITHIN:g}x of the bar)",
                           FLOOR_HANDLE)
    ax.set_xticks(range(len(models)), [_model_tick(m, sub[sub["model"] == m]) for m in models], fontsize=7)
    ax.set_xlim(-0.5, len(models) - 0.5)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(token_label))
    ax.tick_params(axis="y", labelsize=7)
    ax.set_ylabel("max trainable sequence length (tokens)", fontsize=8)
    modes = sorted({_mode(dict(mode=m)) for m in sub.get("mode", pd.Series(["measured"]))})
    ax.set_title(f"{device} ({', '.join(modes)})", fontsize=9)
    top = lengths.max() if len(lengths) else floor_y
    ax.set_ylim(bottom=floor_y / 2, top=max(top * 2, floor_drawn * 1.5, marked * 2))


def _key(stage: int | None) -> int:
    return -1 if stage is None else stage


def _stages(table: pd.DataFrame) -> pd.Series:
    """Each row's ZeRO stage, -1 where the records name none (comparable with `_key`)."""
    if "zero" not in table:
        return pd.Series(-1, index=table.index)
    return pd.to_numeric(table["zero"], errors="coerce").fillna(-1).astype(int)


def trainability_ratios(table: pd.DataFrame, claims: pd.DataFrame | None = None) -> pd.DataFrame:
    """AutoSP's max length over every other method's, per setting, like with like: AutoSP at the baseline's ZeRO
    stage where it ran that stage, else its longest. A method measured only on the HF variant of a model
    (`hf:<preset>`, DeepSpeed's AutoSP) is compared with AutoSP on that variant, else on the model itself.
    Columns: setting, `baseline` (its label), `method`, `zero` (its stage, -1 unknown), `ratio`, `claim` (the
    paper's claimed ratios for it)."""
    claims = paper_claims() if claims is None else claims
    group = [c for c in TRAINABILITY_GROUP if c in table]
    table = table.assign(_length=[_length(r) for _, r in table.iterrows()], _stage=_stages(table))
    ours = table[(table["method"] == OURS) & table["_length"].notna()]
    setting = [c for c in group if c != "model"]
    multi = _multi_stage(table)
    rows = []
    for _, base in table[(table["method"] != OURS) & table["_length"].notna()].iterrows():
        mine = ours
        for column in group:
            mine = mine[(mine[column] == base[column]) | (mine[column].isna() & pd.isna(base[column]))] \
                if column != "model" else mine
        model = base["model"]
        if not (mine["model"] == model).any():
            model = str(model).removeprefix("hf:")
        mine = mine[mine["model"] == model]
        if mine.empty:
            continue
        same = mine[mine["_stage"] == base["_stage"]]
        ref = same.iloc[0] if len(same) else mine.loc[mine["_length"].idxmax()]
        label = base["method"] + (f" ZeRO-{int(base['_stage'])}" if base["method"] in multi else "")
        rows.append({**{c: base[c] for c in setting}, "model": model, "baseline": label, "method": base["method"],
                     "zero": base["_stage"], "ratio": ref["_length"] / base["_length"],
                     "claim": _claim_text(base["method"], claims)})
    return pd.DataFrame(rows, columns=[*setting, "model", "baseline", "method", "zero", "ratio", "claim"])


def _claim_text(method: str, claims: pd.DataFrame) -> str:
    """The paper's claimed trainability ratios against the baseline `method` stands for, one a line (`2.7x NVIDIA`)."""
    names = [name for name, methods in CLAIM_BASELINE_METHODS.items() if method in methods]
    rows = claims[(claims["metric"] == "max_trainable_seq_len_ratio") & claims["autosp_vs"].isin(names)]
    return "\n".join(f"{c['factor']:g}x {c['hardware']}" + (f"\n({c['model']})" if str(c["model"]).lower() != "up to"
                                                               else "") for _, c in rows.iterrows())


def _ratio_panel(ax: plt.Axes, ratios: pd.DataFrame, devices: int) -> None:
    """AutoSP's ratios as an annotated grid: one row per setting, one column per baseline (its paper claim in the
    header), cells coloured by the ratio on a log scale (red: AutoSP trains longer)."""
    if ratios.empty:
        ax.axis("off")
        ax.text(0.5, 0.5, "no ratio: AutoSP and a baseline\nnever both trained in one setting", ha="center",
                va="center", fontsize=8, transform=ax.transAxes)
        return
    def row_label(r: pd.Series) -> str:
        device = r.get("device_name") if isinstance(r.get("device_name"), str) else r.get("device")
        return f"{r['model']}" + (f" · {device}" if devices > 1 else "") + f" ({_mode(r)})"

    rank = {m: i for i, m in enumerate(SERIES_ORDER)}
    ratios = ratios.assign(_row=[row_label(r) for _, r in ratios.iterrows()],
                           _order=[(rank.get(m, len(rank)), m, -z)
                                   for m, z in zip(ratios["method"], ratios["zero"], strict=True)])
    rows = list(dict.fromkeys(ratios.sort_values("model", key=lambda m: m.map(model_order), kind="stable")["_row"]))
    columns = list(dict.fromkeys(ratios.sort_values("_order")["baseline"]))
    grid = np.full((len(rows), len(columns)), np.nan)
    for _, r in ratios.iterrows():
        grid[rows.index(r["_row"]), columns.index(r["baseline"])] = r["ratio"]
    logs = np.log2(grid)
    span = max(float(np.nanmax(np.abs(logs))), 1.0)
    ax.imshow(logs, cmap="RdBu_r", vmin=-span, vmax=span, aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
        if not math.isnan(value):
            ax.text(j, i, f"{value:.2f}×", ha="center", va="center", fontsize=7,
                    color="white" if abs(math.log2(value)) > 0.6 * span else "black")
    claims = ratios.drop_duplicates("baseline").set_index("baseline")["claim"]
    headers = [f"vs {c}" + (f"\npaper:\n{claims[c]}" if claims[c] else "") for c in columns]
    ax.set_xticks(range(len(columns)), headers, fontsize=7)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.tick_params(length=0)
    ax.set_title("AutoSP max length / baseline max length (like ZeRO stage with like)", fontsize=9)


def draw_trainability(table: pd.DataFrame, claims: pd.DataFrame | None = None,
                      published: pd.DataFrame | None = None) -> plt.Figure:
    """One panel per device type (max trainable length per model and method; the published peers' lengths measured
    there as markers) and a grid of AutoSP's ratios to every other method present, the paper's claims in its column
    headers."""
    published = peers_published() if published is None else published
    panels = _device_panels(table)
    series = _series(table)
    multi = _multi_stage(table)
    names = [f"d{i}" for i in range(len(panels))]
    wide = len(panels) <= 2
    mosaic = [names + ["ratios"]] if wide else [names, ["ratios"] * len(names)]
    ratios = trainability_ratios(table, claims)
    rows = max(ratios.groupby([c for c in ratios.columns if c not in ("baseline", "method", "zero", "ratio", "claim")],
                              dropna=False).ngroups if len(ratios) else 1, 1)
    size = (6.5 * len(panels) + 5.5, 6) if wide else (6 * len(panels), 6.5 + 0.32 * rows)
    fig, axes = plt.subplot_mosaic(mosaic, figsize=size, layout="constrained",
                                   height_ratios=None if wide else [6, 0.6 + 0.32 * rows])
    handles: dict[str, object] = {}
    for name, (device, sub) in zip(names, panels, strict=True):
        _trainability_panel(axes[name], device, sub, series, multi, handles, published)
    _ratio_panel(axes["ratios"], ratios, len(panels))
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=min(len(handles), 4),
               fontsize=7, frameon=False)
    return fig


def trainability_figure(table: pd.DataFrame, path: str | Path | list[str | Path],
                        claims: pd.DataFrame | None = None) -> None:
    """`draw_trainability`, written to each path."""
    save_figure(draw_trainability(table, claims), path)


def _failed_runs(records: pd.DataFrame | None) -> pd.DataFrame:
    if records is None or records.empty or "status" not in records:
        return pd.DataFrame(columns=["model", "method", "seq_len", "status", "error"])
    runs = records[(records["status"] != "ok")]
    if "kind" in runs:
        runs = runs[runs["kind"].isna()]
    return runs


def throughput_figure(table: pd.DataFrame, path: str | Path | list[str | Path], claims: pd.DataFrame | None = None,
                      reference: str = "ulysses", records: pd.DataFrame | None = None) -> None:
    """`draw_throughput`, written to each path."""
    save_figure(draw_throughput(table, claims, reference, records), path)


def draw_throughput(table: pd.DataFrame, claims: pd.DataFrame | None = None, reference: str = "ulysses",
                    records: pd.DataFrame | None = None) -> plt.Figure:
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
        model = dict(zip(group, key if isinstance(key, tuple) else (key,), strict=True)).get("model")
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
    return fig


def memory_figure(table: pd.DataFrame, path: str | Path | list[str | Path], baseline: str,
                  claims: pd.DataFrame | None = None) -> None:
    """`draw_memory`, written to each path."""
    save_figure(draw_memory(table, baseline, claims), path)


def draw_memory(table: pd.DataFrame, baseline: str, claims: pd.DataFrame | None = None) -> plt.Figure:
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
    for i, (_, factor, style) in enumerate(bars):
        right.barh(i, factor, **style)
        right.annotate(f"{factor:.2f}×" if factor else "all recomputed", (factor, i), va="center", fontsize=7)
    right.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    right.set_xlim(right=1.15 * max([factor for _, factor, _ in bars] + [1.0]))  # room for the last label
    right.invert_yaxis()
    right.axvline(1.0, color="k", lw=0.8)
    right.set_xlabel(f"reduction: {baseline} bytes / method bytes")
    right.set_title("measured here (method colours) vs paper claims (hatched)", fontsize=9)
    return fig


def sac_figure(table: pd.DataFrame, path: str | Path | list[str | Path], claims: pd.DataFrame | None = None) -> None:
    """`draw_sac`, written to each path."""
    save_figure(draw_sac(table, claims), path)


def draw_sac(table: pd.DataFrame, claims: pd.DataFrame | None = None) -> plt.Figure:
    """SAC's price and payoff per policy: step-time overhead vs max-length gain, both against policy `off`,
    with the paper's ~7% / 1.66x (hatched box); policies whose search or bench failed are listed with why."""
    claims = paper_claims() if claims is None else claims
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    markers = dict(zip(table["policy"], "osD^vP*X", strict=False))
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
    right.margins(y=0.15)  # room for the labels above the bars
    right.set_ylabel("max trainable length (tokens, log2)")
    for x, (_, row) in zip(xs, table.iterrows(), strict=True):
        if pd.notna(row["iter_time_s"]):
            right.annotate(f"{row['iter_time_s'] * 1e3:.0f} ms/step\nat S={int(row['seq_len'])}",
                           (x, max(float(row["max_seq_len"]) if pd.notna(row["max_seq_len"]) else 1, 1)),
                           ha="center", va="bottom", fontsize=6)
    model = table["model"].dropna().iloc[0] if table["model"].notna().any() else ""
    right.set_title(f"autosp per SAC policy · {model}", fontsize=9)
    return fig


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
    from autosp.experiments.tables import (
        load_checks,
        memory_table,
        records_from_args,
        sac_table,
        throughput_table,
        trainability_table,
    )

    for path in args.out:
        check_figure_path(path)
    if args.kind == "simulated":  # an `autosp simulate-table` table (.md): its rows are not committed
        from autosp.experiments.tables import simulated_table_rows

        trainability_figure(pd.concat([trainability_table(simulated_table_rows(path)) for path in args.inputs],
                                      ignore_index=True), args.out)
        print(f"wrote {' '.join(args.out)}")
        return 0
    records = records_from_args(args)
    if args.kind == "peers":
        from autosp.experiments.peer_plot import peers_figure

        peers_figure(records, args.model, args.out)
    elif args.kind == "trainability":
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
    """`autosp plot trainability|throughput|memory|sac|simulated|peers --in FILES... --out figure.png [figure.pdf]`
    (simulated: --in an `autosp simulate-table` Markdown table, e.g. results/simulated_table.md; peers: one model's
    lengths per GPU setting beside the published peers, `autosp.experiments.peer_plot`)."""
    p = subparsers.add_parser("plot", help="paper-style figures (with the paper's claims) from result records")
    p.add_argument("kind", choices=["trainability", "throughput", "memory", "sac", "simulated", "peers"])
    add_records_arguments(p)
    p.add_argument("--out", nargs="+", required=True, help="figure files, format by suffix (.png, .pdf)")
    p.add_argument("--ratio-to", default="ulysses", help="throughput: reference method")
    p.add_argument("--checks", nargs="*", default=[], help="trainability: `autosp check --json-out` reports")
    p.add_argument("--baseline", default="single", help="memory: the method reductions are taken against")
    p.add_argument("--model", default="llama-3.1-8b", help="peers: the model (hf: forms count as the same model)")
    p.set_defaults(func=_cmd_plot)
