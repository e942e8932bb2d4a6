"""`autosp plot peers`: one model's longest trainable sequence per GPU setting (device type x GPUs), the methods'
simulated or measured lengths as bars and the published peers' lengths (`autosp table peers`) as labelled markers.

Where the published anchors were measured (ALST on 1/8/32 H100 and 1 H200, UPipe on 8 and 16 H100) there is no
result of ours unless a record says so: a bar is a search's longest length, or a length that fit (a lower bound,
drawn pale with `>=`; simulated bars hatched, as in every figure); a published length is a claim of its authors,
never drawn as a bar."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from autosp.experiments.plots import PEER_MARKERS, method_color, save_figure, token_label
from autosp.experiments.tables import SAME_SHAPES, peer_lengths, peers_published
from autosp.harness.config import ConfigError


def _short_tokens(value: float) -> str:
    """A bar's length in three significant digits: 4.25M, 464K."""
    return f"{value / 2**20:.3g}M" if value >= 2**20 else f"{value / 1024:.3g}K"


def draw_peers(records: pd.DataFrame, model: str, published: pd.DataFrame | None = None) -> plt.Figure:
    """Bars of `peer_lengths` per setting (log scale), the published anchors of `model` as markers."""
    published = peers_published() if published is None else published
    # a longest length each (a throughput anchor, torchtitan's, is a length it ran at, not the longest it trains)
    anchors = published[published["model"].isin((model, *SAME_SHAPES.get(model, ())))
                        & published["seq_len"].notna() & published["tokens_per_s_per_gpu"].isna()]
    ours = peer_lengths(records, model)
    if ours.empty and anchors.empty:
        raise ConfigError(f"no records and no published lengths of {model}: check --model and --in")
    settings = sorted({(d, int(w)) for d, w in zip(ours["device"], ours["world_size"], strict=True)}
                      | {(d, int(w)) for d, w in zip(anchors["device"], anchors["world_size"], strict=True)},
                      key=lambda s: (s[1], s[0]))
    methods = sorted(set(ours["method"]), key=lambda m: (not m.startswith("autosp"), m))
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(1.6 * len(settings) + 3, 4.5), layout="constrained")
    for i, method in enumerate(methods):
        for _, row in ours[ours["method"] == method].iterrows():
            x = settings.index((row["device"], int(row["world_size"]))) - 0.4 + width * (i + 0.5)
            simulated = row["mode"] == "simulated"  # hatched, as in every figure; a lower bound is paler
            ax.bar(x, row["length"], width, color=method_color(method), hatch="///" if simulated else None,
                   edgecolor="white" if simulated else "0.2", linewidth=0.5, alpha=0.45 if row["bound"] else 1.0)
            ax.annotate(f"{'>=' if row['bound'] else ''}{_short_tokens(row['length'])}", (x, row["length"]),
                        fontsize=6, ha="center", va="bottom", rotation=90, xytext=(0, 2), textcoords="offset points")
    for _, anchor in anchors.iterrows():
        x = settings.index((anchor["device"], int(anchor["world_size"])))
        ax.plot(x, anchor["seq_len"], PEER_MARKERS.get(anchor["peer"], "o"), color="k", markersize=9)
        ax.annotate(f"{anchor['peer']} (published{'' if anchor['model'] == model else ', ' + anchor['model']})",
                    (x, anchor["seq_len"]), fontsize=6, xytext=(6, -3), textcoords="offset points")
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(plt.FuncFormatter(token_label))
    ax.set_xticks(range(len(settings)), [f"{w} x {d}" for d, w in settings], fontsize=8)
    ax.set_ylabel("longest trainable sequence (tokens)")
    ax.set_title(f"{model}: ours (bars) and the published peers (markers)", fontsize=10)
    modes = {m: " / ".join(sorted(set(ours.loc[ours["method"] == m, "mode"]))) for m in methods}
    handles = [Patch(facecolor=method_color(m), edgecolor="white", hatch="///" if "simulated" in modes[m] else None,
                     label=f"{m} ({modes[m]})") for m in methods]
    handles += [Patch(facecolor="0.5", alpha=0.45, label=">= a length that fits (lower bound)")]
    handles += [Line2D([], [], marker=PEER_MARKERS.get(p, "o"), color="k", linestyle="", label=f"{p} (published)")
                for p in sorted(set(anchors["peer"]))]
    ax.legend(handles=handles, fontsize=7, loc="upper left", frameon=False)
    return fig


def peers_figure(records: pd.DataFrame, model: str, path: str | Path | list[str | Path]) -> None:
    """`draw_peers` written to each path."""
    save_figure(draw_peers(records, model), path)
