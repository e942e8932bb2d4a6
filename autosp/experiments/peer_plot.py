"""`autosp plot peers`: one model's longest trainable sequence per GPU setting (device type x GPUs), the methods'
simulated or measured lengths as bars and the published peers' lengths (`autosp table peers`) as labelled markers.

Where the published anchors were measured (ALST on 1/8/32 H100 and 1 H200, UPipe on 8 and 16 H100) there is no
result of ours unless a record says so: a bar is a search's longest length, or a length that fit (a lower bound,
drawn hatched with `>=`); a published length is a claim of its authors, never drawn as a bar."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from autosp.experiments.plots import _save, _tokens, method_color
from autosp.experiments.tables import peers_published
from autosp.harness.config import ConfigError

#: the published peers' markers
PEER_MARKERS = {"alst": "*", "upipe": "D"}
#: a published model of the same architecture as the one plotted (UPipe trains Llama-3-8B: Llama-3.1-8B's shapes)
SAME_SHAPES = {"llama-3.1-8b": ("llama-3-8b",)}


def _model(name: object) -> str:
    return str(name).rpartition(":")[2]


def peer_lengths(records: pd.DataFrame, model: str) -> pd.DataFrame:
    """Per (device, world_size, method): the longest length `model` trains in `records` (searches: their answer;
    single runs: the longest that fit) and whether it is a lower bound (a single run, or a search that reached its
    --max-len). A method run with options of its own (`method_spec`) is its own method."""
    rows = records[records["model"].map(_model) == model].copy()
    for column in ("kind", "max_seq_len", "seq_len", "method_spec"):  # a file of searches only, or of runs only
        if column not in rows:
            rows[column] = None
    rows["method"] = rows["method_spec"].fillna(rows["method"])
    kind = rows["kind"]
    searches = rows[kind == "search"].assign(length=lambda r: pd.to_numeric(r["max_seq_len"], errors="coerce"),
                                             bound=lambda r: r["status"] == "no_oom_up_to_max_len")
    fits = rows[(kind != "search") & (rows["status"] == "ok")]
    fits = fits.assign(length=pd.to_numeric(fits["seq_len"], errors="coerce"), bound=True)
    both = pd.concat([searches, fits], ignore_index=True).dropna(subset=["length"])
    both = both[both["length"] > 0]
    if both.empty:
        return pd.DataFrame(columns=["device", "world_size", "method", "length", "bound"])
    best = both.sort_values(["length", "bound"], ascending=[True, False]).groupby(
        ["device", "world_size", "method"], as_index=False).last()
    return best[["device", "world_size", "method", "length", "bound"]].reset_index(drop=True)


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
            ax.bar(x, row["length"], width, color=method_color(method), hatch="//" if row["bound"] else None,
                   edgecolor="0.2", linewidth=0.5)
            ax.annotate(f"{'>=' if row['bound'] else ''}{_tokens(row['length'])}", (x, row["length"]), fontsize=6,
                        ha="center", va="bottom", rotation=90, xytext=(0, 2), textcoords="offset points")
    for _, anchor in anchors.iterrows():
        x = settings.index((anchor["device"], int(anchor["world_size"])))
        ax.plot(x, anchor["seq_len"], PEER_MARKERS.get(anchor["peer"], "o"), color="k", markersize=9)
        ax.annotate(f"{anchor['peer']} (published{'' if anchor['model'] == model else ', ' + anchor['model']})",
                    (x, anchor["seq_len"]), fontsize=6, xytext=(6, -3), textcoords="offset points")
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(plt.FuncFormatter(_tokens))
    ax.set_xticks(range(len(settings)), [f"{w} x {d}" for d, w in settings], fontsize=8)
    ax.set_ylabel("longest trainable sequence (tokens)")
    ax.set_title(f"{model}: ours (bars) and the published peers (markers)", fontsize=10)
    handles = [Patch(facecolor=method_color(m), edgecolor="0.2", label=m) for m in methods]
    handles += [Patch(facecolor="white", edgecolor="0.2", hatch="//", label=">= a length that fits (lower bound)")]
    handles += [Line2D([], [], marker=PEER_MARKERS.get(p, "o"), color="k", linestyle="", label=f"{p} (published)")
                for p in sorted(set(anchors["peer"]))]
    ax.legend(handles=handles, fontsize=7, loc="upper left", frameon=False)
    return fig


def peers_figure(records: pd.DataFrame, model: str, path: str | Path | list[str | Path]) -> None:
    """`draw_peers` written to each path."""
    _save(draw_peers(records, model), path)
