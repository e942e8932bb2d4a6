"""The history as figures (PNG and PDF) and a static dashboard page that opens from disk with no server.

One panel per series and machine: every raw sample per commit (dots), the median (line), the baseline band
(the baseline's median ± the regression threshold: outside it, a change is big enough to count) and the
points flagged against the commit measured before them (red: regression, green: improvement).
"""
from __future__ import annotations

import base64
import html
import io
import itertools
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on clusters or CI
import matplotlib.pyplot as plt
import pandas as pd

from autosp.experiments.history.compare import (
    IMPROVEMENT,
    REGRESSION,
    compare,
    compare_samples,
    format_table,
    ordered_points,
    resolve,
    series_label,
    with_points,
)

_FLAG_STYLE = {REGRESSION: {"color": "tab:red", "marker": "X", "s": 90},
               IMPROVEMENT: {"color": "tab:green", "marker": "^", "s": 70}}


def _series_panels(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    panels = []
    multi_machine = df["machine"].nunique() > 1
    for (machine, _), series in df.groupby(["machine", "series"]):
        title = series_label(series.iloc[0])
        panels.append((f"{title}\n{machine}" if multi_machine else title, series))
    return panels


def draw_history(history: pd.DataFrame, *, threshold: float, alpha: float, base: str | None = None) -> plt.Figure:
    """The figure: one panel per series; x = recorded commits in commit order."""
    df = with_points(history)
    points = ordered_points(df)
    panels = _series_panels(df)
    base = resolve(base, df) if base else None
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.4 * rows), squeeze=False,
                             constrained_layout=True)
    for ax, (title, series) in zip(axes.flat, panels):
        walk = [p for p in points if p in set(series["point"])]
        x_of = {p: i for i, p in enumerate(walk)}
        medians = series.groupby("point")["value"].median().reindex(walk)
        ax.scatter(series["point"].map(x_of), series["value"], s=8, color="0.55", alpha=0.6, label="samples")
        ax.plot(range(len(walk)), medians.to_numpy(), "-o", color="tab:blue", ms=4, label="median")
        base_point = base if base in x_of else walk[0]
        baseline = medians[base_point]
        ax.axhspan(baseline * (1 - threshold), baseline * (1 + threshold), color="tab:blue", alpha=0.12,
                   label=f"baseline {base_point[:9]} ±{threshold:.0%}")
        metric = series["metric"].iloc[0]
        by_point = dict(iter(series.groupby("point")))
        for before, after in itertools.pairwise(walk):
            verdict = compare_samples(metric, by_point[before]["value"].to_numpy(float),
                                      by_point[after]["value"].to_numpy(float), threshold=threshold,
                                      alpha=alpha)["verdict"]
            if verdict in _FLAG_STYLE:
                ax.scatter([x_of[after]], [medians[after]], zorder=5, label=verdict, **_FLAG_STYLE[verdict])
        ax.set_xticks(range(len(walk)), [p[:9] + ("*" if p.endswith("dirty") else "") for p in walk],
                      rotation=30, fontsize=7)
        ax.set_title(title, fontsize=8)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=6, loc="best")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("AutoSP history: metric per commit (* = uncommitted changes)", fontsize=10)
    return fig


def save_figure(fig: plt.Figure, out: str | Path) -> list[Path]:
    """Write `out` (PNG) and the PDF beside it, each atomically; return both paths."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for path in (out.with_suffix(".png"), out.with_suffix(".pdf")):
        tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
        fig.savefig(tmp, dpi=130, bbox_inches="tight")
        tmp.replace(path)
        written.append(path)
    plt.close(fig)
    return written


def write_dashboard(history: pd.DataFrame, out: str | Path, *, threshold: float, alpha: float,
                    base: str | None = None) -> Path:
    """One self-contained HTML page (the figure inlined): the recorded commits, the latest comparison,
    and the figure. Opens from disk; no server, no script."""
    df = with_points(history)
    fig = draw_history(history, threshold=threshold, alpha=alpha, base=base)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    image = base64.b64encode(buffer.getvalue()).decode()
    commits = (df.groupby(["point", "machine"], sort=False)
               .agg(commit_time=("commit_time", "first"), hostname=("hostname", "first"),
                    samples=("value", "size"), recorded_at=("recorded_at", "max")).reset_index())
    table, info = compare(history, base=base, threshold=threshold, alpha=alpha)
    against = ", ".join(f"{b} on {m}" for m, b in info["bases"].items()) or "nothing earlier on the same machine"
    body = [
        "<h1>AutoSP regression history</h1>",
        (f"<p>threshold {threshold:.0%}, significance {alpha} (Mann-Whitney U; 95% bootstrap interval of the "
         "change of the median). Trainability is compared exactly.</p>"),
        "<h2>Recorded commits</h2>", commits.to_html(index=False, border=0),
        f"<h2>Latest: {html.escape(info['head'])} against {html.escape(against)}</h2>",
        f"<pre>{html.escape(format_table(table))}</pre>",
        f"<img alt='history figure' src='data:image/png;base64,{image}' style='max-width:100%'>",
    ]
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>AutoSP history</title><style>"
            "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{padding:2px 8px;"
            "border-bottom:1px solid #ddd;font-size:13px}pre{font-size:12px}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out
