"""Result tables from records: trainability per method (with ratios to the baselines) and throughput.

Tables read records only (JSONL written by `autosp search` / `autosp bench` / `autosp run`), never live
objects, so CPU runs, cluster runs and simulated runs all flow through the same code, told apart by their
`device` / `mode` columns. The paper's claims come from a copy of the reference data inside the package.
"""
from __future__ import annotations

import argparse
import io
import itertools
import re
import sys
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from autosp.errors import ConfigError

#: runs are comparable only within one (model, ranks, device type, budget) setting, measured or simulated
TRAINABILITY_GROUP = ["model", "world_size", "device", "device_name", "memory_budget", "mode"]
THROUGHPUT_GROUP = ["model", "world_size", "device", "seq_len"]
#: the baselines the paper compares AutoSP's trainability with (it names ZeRO-3 "ZeRO-3 (FSDP)": both are kept),
#: then the practical anchors: ALST and Ulysses with per-layer activation checkpointing, as practitioners run them
TRAINABILITY_REFERENCES = ("ulysses", "ds-autosp", "zero3", "fsdp", "alst", "ulysses[ac=layer]")
#: methods whose numbers depend on a compile backend: only their rows name one
COMPILED_METHODS = ("autosp", "ulysses-compile", "ds-autosp")
ITER_TIME_MEDIAN = "iter_time_s.median"  # flattened name of the record's iter_time_s.median
CPU_TIME_MEDIAN = "extra.cpu_time_s.median"  # CPU seconds per step of the busiest rank (runner)


def paper_claims() -> pd.DataFrame:
    """The paper's headline claims (`autosp/reference/paper_claims.csv`): claims, never measurements."""
    text = resources.files("autosp").joinpath("reference/paper_claims.csv").read_text()
    return pd.read_csv(io.StringIO(text))


def alst_published() -> pd.DataFrame:
    """ALST's published longest lengths and ablation (`autosp/reference/alst_published.csv`): claims, never
    measurements."""
    text = resources.files("autosp").joinpath("reference/alst_published.csv").read_text()
    return pd.read_csv(io.StringIO(text))


def peers_published() -> pd.DataFrame:
    """Every published peer anchor, one row each with its source: ALST's headline lengths (`alst_published.csv`)
    and the rest (`autosp/reference/peers_published.csv`: ALST on one H200, UPipe, torchtitan's context-parallel
    throughput). Claims, never measurements: `autosp table peers` prints them."""
    alst = alst_published().query("kind == 'headline'").assign(peer="alst", tokens_per_s_per_gpu=None)
    text = resources.files("autosp").joinpath("reference/peers_published.csv").read_text()
    columns = ["peer", "model", "device", "world_size", "seq_len", "tokens_per_s_per_gpu", "recipe", "source"]
    table = pd.concat([alst[columns], pd.read_csv(io.StringIO(text))[columns]], ignore_index=True)
    table["tokens_per_s_per_gpu"] = table["tokens_per_s_per_gpu"].astype("Int64")
    return table.sort_values(["model", "peer", "device", "world_size"], ignore_index=True)


#: a published model of the same architecture as ours (UPipe trains Llama-3-8B: Llama-3.1-8B's shapes)
SAME_SHAPES = {"llama-3.1-8b": ("llama-3-8b",)}
#: our methods put beside the published peers' lengths (`peers_table`)
PEER_COLUMNS = ("autosp", "alst")
#: a throughput anchor's GPU that the device catalogue lacks -> the catalogue's GPU of the same chip its speed is
#: compared on (torchtitan's H100 96GB HBM2e at 500 W: the H100 SXM's 80 GB at 700 W, so ours is likely optimistic)
SAME_CHIP = {"h100-96gb": "h100-80gb"}


def _base_model(name: object) -> str:
    return str(name).rpartition(":")[2]


def peer_lengths(records: pd.DataFrame, model: str) -> pd.DataFrame:
    """Per (device, world_size, method): the longest length `model` trains in `records` (searches: their answer;
    single runs: the longest that fit) and whether it is a lower bound (a single run, or a search that reached its
    --max-len), and its `mode` (measured or simulated). A method run with options of its own (`method_spec`) is its own
    method."""
    rows = records[records["model"].map(_base_model) == model].copy()
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
    columns = ["device", "world_size", "method", "length", "bound", "mode"]
    if both.empty:
        return pd.DataFrame(columns=columns)
    both["mode"] = both["mode"].fillna("measured") if "mode" in both else "measured"
    best = both.sort_values(["length", "bound"], ascending=[True, False]).groupby(
        ["device", "world_size", "method"], as_index=False).last()
    return best[columns].reset_index(drop=True)


def peer_speeds(records: pd.DataFrame, model: str) -> pd.DataFrame:
    """Per (device, world_size, method, length): tokens/s per GPU of `model`'s latest run that fit at that length
    (not a search): a measured run's median step over its GPUs where there is one (a measurement outranks any
    prediction, however recent), else a simulated run's predicted step (`extra.time`)."""
    columns = ["device", "world_size", "method", "length", "tokens_per_s_per_gpu", "mode"]
    rows = records[records["model"].map(_base_model) == model]

    def column(name: str) -> pd.Series:
        return rows[name] if name in rows else pd.Series(None, index=rows.index, dtype=object)

    rows = rows[(column("kind") != "search") & (column("status") == "ok")]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    mode = column("mode").fillna("measured")
    predicted = pd.to_numeric(column("extra.time.tokens_per_s_per_gpu"), errors="coerce")
    measured = pd.to_numeric(column("tokens_per_s"), errors="coerce") / rows["world_size"]
    speeds = pd.DataFrame({"device": rows["device"], "world_size": rows["world_size"],
                           "method": column("method_spec").fillna(rows["method"]),
                           "length": pd.to_numeric(rows["seq_len"], errors="coerce"), "mode": mode,
                           "tokens_per_s_per_gpu": predicted.where(mode == "simulated", measured),
                           "timestamp": column("timestamp")})
    speeds = speeds.assign(measured=speeds["mode"] != "simulated").dropna(subset=["length", "tokens_per_s_per_gpu"])
    speeds = speeds.sort_values(["measured", "timestamp"], kind="stable")
    return speeds.groupby(["device", "world_size", "method", "length"], as_index=False).last()[columns]


def peers_table(records: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every published peer anchor (`peers_published`); with `records`, our longest length of each method of
    `PEER_COLUMNS` at the anchor's model (or one of the same shapes), device type and GPU count (`peer_lengths`:
    `>=` a lower bound), and autosp's ratio to the published length. A throughput anchor (torchtitan's) is a length it
    ran at, not its longest: beside it, our tokens/s per GPU at that length on its GPU (or `SAME_CHIP`'s), predicted
    or measured as the cell says (`peer_speeds`), and autosp's ratio of tokens/s."""
    table = peers_published()
    if records is None:
        return table
    models = {*table["model"], *SAME_SHAPES}
    ours = pd.concat([peer_lengths(records, model).assign(model=model) for model in models], ignore_index=True)
    speeds = pd.concat([peer_speeds(records, model).assign(model=model) for model in models], ignore_index=True)
    same = {alias: model for model, aliases in SAME_SHAPES.items() for alias in aliases}
    out = table.drop(columns=["recipe"])
    for method in PEER_COLUMNS:
        mine, fast = ours[ours["method"] == method], speeds[speeds["method"] == method]
        cells, ratios = [], []
        for _, anchor in table.iterrows():
            names = {anchor["model"], same.get(anchor["model"])}
            if pd.isna(anchor["tokens_per_s_per_gpu"]):
                cell, ratio = _peer_length_cell(mine, names, anchor)
            else:  # a throughput anchor: our speed at its length
                cell, ratio = _peer_speed_cell(fast, names, anchor)
            cells.append(cell)
            ratios.append(ratio)
        out[f"{method} (ours)"] = cells
        if method == "autosp":
            out["autosp / published"] = ratios
    return out[[c for c in out.columns if c != "source"] + ["source"]]


def _peer_length_cell(mine: pd.DataFrame, names: set, anchor: pd.Series) -> tuple[str, str]:
    """(our longest length at a length anchor's model, GPU and count, its ratio to the published length)."""
    hit = mine[mine["model"].isin(names) & (mine["device"] == anchor["device"])
               & (mine["world_size"] == anchor["world_size"])]
    if hit.empty:
        return "", ""
    best = hit.sort_values("length").iloc[-1]
    bound = ">=" if best["bound"] else ""
    return f"{bound}{int(best['length']):,}", f"{bound}{best['length'] / anchor['seq_len']:.2f}x"


def _peer_speed_cell(fast: pd.DataFrame, names: set, anchor: pd.Series) -> tuple[str, str]:
    """(our tokens/s per GPU at a throughput anchor's length, model, GPU (`SAME_CHIP`) and count, its ratio to the
    published tokens/s)."""
    device = SAME_CHIP.get(anchor["device"], anchor["device"])
    hit = fast[fast["model"].isin(names) & (fast["device"] == device) & (fast["world_size"] == anchor["world_size"])
               & (fast["length"] == anchor["seq_len"])]
    if hit.empty:
        return "", ""
    run = hit.iloc[-1]
    how = "predicted" if run["mode"] == "simulated" else "measured"
    return (f"{run['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU ({how}, {device})",
            f"{run['tokens_per_s_per_gpu'] / anchor['tokens_per_s_per_gpu']:.2f}x tokens/s")


def alst_table(records: pd.DataFrame) -> pd.DataFrame:
    """ALST's published lengths (headline rows) beside the alst records of the same model, device type and world
    size: a search's longest length and its ratio to the published one; a run at the published length (its status
    and peak); and where two runs at different lengths exist, `line_max_seq_len`: where the line through the two
    longest crosses the memory they were run against (peaks are linear in the length at long lengths; a line, not a
    search). Measured or simulated alike (`mode` says which); empty cells where no record exists."""
    published = alst_published()
    published = published[published["kind"] == "headline"]
    mine = records[records["method"] == "alst"] if "method" in records else records.iloc[0:0]
    mine = mine.assign(base=mine["model"].astype(str).str.removeprefix("hf:")) if not mine.empty else mine
    rows = []
    for _, claim in published.iterrows():
        cell = mine[(mine["base"] == claim["model"]) & (mine["device"] == claim["device"])
                    & (mine["world_size"] == claim["world_size"])] if not mine.empty else mine
        search = _latest(search_rows(cell), ["world_size"]) if not cell.empty else cell
        at = cell[(cell.get("kind", pd.Series(index=cell.index, dtype=object)) != "search")
                  & (cell["seq_len"] == claim["seq_len"])] if not cell.empty else cell
        found = search["max_seq_len"].iloc[0] if len(search) else None
        runs = cell[(cell.get("kind", pd.Series(index=cell.index, dtype=object)) != "search")
                    & cell.get("peak_mem_bytes", pd.Series(index=cell.index, dtype=float)).notna()] \
            if not cell.empty else cell
        line = None
        if runs["seq_len"].nunique() >= 2 if len(runs) else False:
            (s1, p1, _), (s2, p2, budget) = runs.sort_values("seq_len").drop_duplicates("seq_len", keep="last")[
                ["seq_len", "peak_mem_bytes", "memory_budget"]].to_numpy()[-2:]
            line = int(s2 + (budget - p2) * (s2 - s1) / (p2 - p1)) if p2 > p1 else None
        row = {"model": claim["model"], "device": claim["device"], "world_size": int(claim["world_size"]),
               "published": int(claim["seq_len"]), "mode": (search if len(search) else at)["mode"].iloc[0]
               if len(search) or len(at) else None,
               "max_seq_len": found, "max_over_published": found / claim["seq_len"] if found else None,
               "line_max_seq_len": line, "line_over_published": line / claim["seq_len"] if line else None,
               "at_published": at["status"].iloc[-1] if len(at) else None,
               "peak_at_published_gib": at["peak_mem_bytes"].iloc[-1] / 2**30 if len(at) else None,
               "source": claim["source"]}
        rows.append(row)
    return pd.DataFrame(rows)


def _latest(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """One row per key: the most recent (a re-run search supersedes the old one)."""
    order = df.sort_values("timestamp", kind="stable") if "timestamp" in df else df
    return order.drop_duplicates(subset=keys, keep="last")


def _ratio_to(table: pd.DataFrame, group: list[str], value: str, reference: str) -> pd.Series:
    """value / value of `reference` method in the same group (NaN where either was not measured); where the
    reference ran at several ZeRO stages, the one at this row's stage (like with like), else its first."""
    ref = table.loc[table["method"] == reference, group + [value] + (["zero"] if "zero" in table else [])]
    ref = ref.rename(columns={value: "_ref"})
    merged = table[group].merge(ref.drop(columns="zero", errors="ignore").drop_duplicates(group), on=group, how="left")
    if "zero" in table:
        same_stage = table[group + ["zero"]].merge(ref, on=group + ["zero"], how="left")["_ref"]
        merged["_ref"] = same_stage.fillna(merged["_ref"]).to_numpy()
    values = pd.to_numeric(table[value], errors="coerce").to_numpy(dtype=float)
    return pd.Series(values / pd.to_numeric(merged["_ref"], errors="coerce").to_numpy(dtype=float), index=table.index)


def method_variant(method: str, ac: object) -> str:
    """A method's row label: `ulysses[ac=layer]` for a run with per-layer activation checkpointing (`--ac layer`),
    so that it stands beside plain `ulysses` as its own row, never in its place."""
    return f"{method}[ac={ac}]" if isinstance(ac, str) and ac not in ("", "off") else method


def search_rows(records: pd.DataFrame) -> pd.DataFrame:
    """The result rows of searches (kind == "search"), without their probe records."""
    if "kind" not in records:
        return records.iloc[0:0]
    return records[records["kind"] == "search"]


#: a simulated search row's predicted step at its longest length (`autosp.experiments.simulate.speed`), kept beside it
TIME_COLUMNS = ("extra.time.iteration_s", "extra.time.tokens_per_s_per_gpu", "extra.time.time_model")


def trainability_table(records: pd.DataFrame, references: tuple[str, ...] = TRAINABILITY_REFERENCES,
                       checks: pd.DataFrame | None = None) -> pd.DataFrame:
    """Max trainable length per method and setting, achieved/limit, and ratios `vs_<ref>` to each baseline.

    Failed cells keep their row (status and `error`). With `checks` (from `load_checks`), each cell that was
    checked against single-process training gets `gradient_check`: its verdict and worst gradient error."""
    rows = search_rows(records)
    if rows.empty:
        raise ConfigError("no search results in the given records; run `autosp search ... --out FILE` first")
    rows = rows.assign(**{c: None for c in ("mode", "compile_backend", "error") if c not in rows})
    rows = rows.assign(mode=rows["mode"].fillna("measured"),  # simulated rows say so (`autosp simulate`)
                       compile_backend=rows["compile_backend"].where(rows["method"].isin(COMPILED_METHODS)))
    ac = next((c for c in ("ac", "config.ac") if c in rows), None)  # a record keeps it in its config
    if ac is not None:  # a checkpointed variant is a row of its own, labelled (`method_variant`)
        rows = rows.assign(method=[method_variant(m, a) for m, a in zip(rows["method"], rows[ac], strict=True)])
    if "method_spec" in rows:  # a method run with its own options (`autosp[sac=auto]`) is a row of its own
        rows = rows.assign(method=rows["method_spec"].fillna(rows["method"]))
    group = [c for c in TRAINABILITY_GROUP if c in rows]
    stage = ["zero"] if "zero" in rows else []  # the ZeRO stage each method ran: a different stage, a different row
    table = _latest(rows, group + ["method"] + stage)
    table = table.assign(peak_bytes_per_token=[
        peak_slope(p, whole_oom_peaks=d == "cpu")
        for p, d in zip(table.get("probes", [None] * len(table)), table.get("device", [None] * len(table)),
                        strict=True)])
    table = table[group + ["method"] + stage + ["compile_backend", "status", "max_seq_len",
                                                "first_oom_seq_len", "floor_limit_seq_len", "achieved_over_limit",
                                                "num_probes", "peak_bytes_per_token", "error"]
                  + [c for c in TIME_COLUMNS if c in table]].copy()
    if checks is not None and not checks.empty:
        table = table.merge(checks, on=["model", "world_size", "method"], how="left")
    table["memory_budget"] = table["memory_budget"].astype("float")  # NaN-safe for merging
    for ref in references:
        table[f"vs_{ref}"] = _ratio_to(table, group, "max_seq_len", ref)
    lengths = ["max_seq_len", "first_oom_seq_len", "floor_limit_seq_len", "num_probes"]
    table[lengths] = table[lengths].astype("Int64")  # lengths stay integers where some are missing
    return table.sort_values(group + ["max_seq_len"], ascending=[True] * len(group) + [False]).reset_index(drop=True)


def peak_slope(probes: object, *, whole_oom_peaks: bool = False) -> float:
    """Bytes of per-rank peak per sequence token: the least-squares slope of peak over length through a search's
    probes that ran (status ok), the figure that says how fast memory grows with the sequence (NaN below two
    lengths). Probes that ran out of memory are left out: where a device really runs out, their peak is cut short;
    under an emulated budget (`whole_oom_peaks`: the CPU runs the whole step, then compares its peak with the
    budget) they count too, so a guided search's two probes give the slope."""
    counted = ("ok", "oom") if whole_oom_peaks else ("ok",)
    points = {(p["seq_len"], p["peak_mem_bytes"]) for p in (probes if isinstance(probes, list) else [])
              if isinstance(p, dict) and p.get("status") in counted and p.get("peak_mem_bytes")}
    if len({length for length, _ in points}) < 2:
        return float("nan")
    lengths, peaks = zip(*sorted(points), strict=True)
    return float(np.polyfit(np.asarray(lengths, float), np.asarray(peaks, float), 1)[0])


def simulated_table_rows(path: str | Path) -> pd.DataFrame:
    """The search rows of an `autosp simulate-table` Markdown table (`results/simulated_table.md`, committed where
    its JSONL rows are not), as records: one per (model, device type, method, ZeRO stage), `mode` simulated. A
    method run on HF's variant of the model (column `ds-autosp (hf) z1`) is given the row's model."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    lines = list(itertools.takewhile(lambda line: line.startswith("|"),  # the first table: the times follow apart
                                     itertools.dropwhile(lambda line: not line.startswith("|"), text.splitlines())))
    if len(lines) < 3 or not lines[0].startswith("| model | device |"):
        raise ConfigError(f"{path}: no `autosp simulate-table` table in it (its first columns are model, device)")
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    world = re.search(r"world size (\d+)", text)
    rows = []
    for line in lines[2:]:
        cells = dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=False))
        for column, value in cells.items():
            label = re.fullmatch(r"(?P<method>[\w.-]+(?:\[[^\[\]]+\])?)(?: \(hf\))? z(?P<zero>\d+)", column)
            if label is None or not value:
                continue
            length = re.fullmatch(r"(?P<more>>=)?(?P<k>[\d.]+)K", value)
            status = ("no_oom_up_to_max_len" if length["more"] else "found") if length else \
                {"oom at min": "oom_at_min_len"}.get(value, value)
            rows.append({"kind": "search", "model": cells["model"], "device": cells["device"],
                         "device_name": cells["device"], "world_size": int(world[1]) if world else None,
                         "memory_budget": float("nan"), "mode": "simulated", "method": label["method"],
                         "zero": int(label["zero"]), "status": status,
                         "max_seq_len": round(float(length["k"]) * 1024) if length else None,
                         "first_oom_seq_len": None, "floor_limit_seq_len": None, "achieved_over_limit": None,
                         "num_probes": None, "error": None})
    return pd.DataFrame(rows)


def model_order(model: str) -> tuple:
    """Models by size where the name says it (`llama-3.2-1b` before `llama-2-13b`), else by name; a model's HF
    variants (`hf:<preset>`, `hf-qwen2:<preset>`) right after it."""
    variant, _, base = str(model).rpartition(":")
    size = re.search(r"(\d+(?:\.\d+)?)b$", base)
    return (float(size[1]) if size else 0.0, base, variant)


#: the peers of the headline table, by class: the strongest method of each class that ran in a setting is its cell
PEER_CLASSES = {
    "hand-written SP": ("ulysses", "ring", "ulysses[ac=layer]", "ring[ac=layer]"),
    "ZeRO-3 / FSDP": ("zero3", "fsdp", "zero3[ac=layer]", "fsdp[ac=layer]"),
    "ds-autosp": ("ds-autosp",),
    "alst": ("alst",),
}
#: the baseline an autosp method spec's column (`autosp[sac=auto,...]`: the planner's levers) is put against
SPEC_RATIO = "alst"
BEST_PEER = "autosp / strongest peer"


def autosp_specs(methods: Iterable[str]) -> list[str]:
    """The autosp columns run with options of their own (`autosp[...]`, `simulate.table.cell_configs`)."""
    return sorted({m for m in methods if m.startswith("autosp[")})


def _length_cell(method: str, best: pd.Series, failed: pd.Series, bounded: set[str], named: bool = False) -> str:
    """A method's headline cell: its longest length (`>=` a lower bound; the method named where asked), `error` (it
    failed), `none fits`, or empty where it did not run."""
    if method not in best:
        return ""
    if not best[method] > 0:
        return "error" if failed[method] else "none fits"
    text = f"{'>=' if method in bounded else ''}{best[method] / 1024:g}K"
    return f"{text} ({method})" if named else text


def headline_table(trainability: pd.DataFrame, devices: list[str] | None = None) -> pd.DataFrame:
    """The README's headline, eight columns: one row per model and setting (measured or simulated, said first),
    AutoSP as it runs by default (`autosp`; the paper's setting and other specs are in the full tables), the
    strongest peer of each class of `PEER_CLASSES` that ran there (its longest trainable length over the ZeRO stages
    it ran, named where the class has several methods), and AutoSP's ratio to the strongest of them all. `>=` marks
    lower bounds."""
    table = trainability.assign(n=pd.to_numeric(trainability["max_seq_len"], errors="coerce").astype(float))
    names = table["device_name"] if "device_name" in table else table["device"]
    # a device type (cpu, a100-80gb) names the setting; a measured GPU's own name stands in for plain "cuda"
    table["where"] = table["device"].where(table["device"] != "cuda", names.fillna(table["device"]))
    if devices:
        table = table[table["where"].isin(devices) | table["device"].isin(devices) | names.isin(devices)]
    present = set(table["method"])
    classes = [name for name, members in PEER_CLASSES.items() if present & set(members)]
    rows = []
    for (mode, where, world, model), cell in table.groupby(["mode", "where", "world_size", "model"], sort=False):
        best = cell.groupby("method")["n"].max()
        failed = cell.groupby("method")["status"].agg(lambda s: bool((s == "error").all()))  # refused or crashed
        # a method with a lower bound (a search that reached its --max-len, one length that fits) has `>=` lengths
        bounded = set(cell.loc[cell["status"] == "no_oom_up_to_max_len", "method"])
        budget = cell["memory_budget"].iloc[0]

        setting = f"{mode}: {where}, {int(world)} ranks" + (f", {budget / 2**20:.0f} MiB" if pd.notna(budget) else "")
        row = {"model": model, "setting": setting, "autosp": _length_cell("autosp", best, failed, bounded)}
        strongest = None
        for name in classes:
            ran = [m for m in PEER_CLASSES[name] if m in best]
            top = max(ran, key=lambda m: best[m] if best[m] > 0 else -1.0, default=None)
            row[name] = _length_cell(top, best, failed, bounded, named=len(PEER_CLASSES[name]) > 1) if top else ""
            if top and best[top] > 0 and (strongest is None or best[top] > best[strongest]):
                strongest = top
        ok = strongest is not None and best.get("autosp", 0) > 0
        # a lower bound of AutoSP's is a lower bound of the ratio; one of the peer's makes it unknown
        row[BEST_PEER] = "" if not ok or strongest in bounded else \
            f"{'>=' if 'autosp' in bounded else ''}{best['autosp'] / best[strongest]:.2f}x"
        rows.append(row)
    if not rows:
        raise ConfigError("no trainability results for the headline table (check --devices)")
    table = pd.DataFrame(rows)
    order = sorted(range(len(table)), key=lambda i: (table["setting"][i], model_order(table["model"][i])))
    return table.iloc[order].reset_index(drop=True)


def throughput_table(records: pd.DataFrame, reference: str | None = "ulysses") -> pd.DataFrame:
    """Iteration time and tokens/s per (setting, length, method) with spread over repeated runs.

    Each run contributes its median step time; the table gives the median, min and max of those over the
    repeats, and `speed_vs_<reference>` = reference time / this time (> 1: faster than the reference), the
    paper's "iteration speed"; `tokens_per_s_vs_<reference>` compares throughput.
    """
    runs = records
    if "kind" in runs:
        runs = runs[runs["kind"].isna() | (runs["kind"] != "search")]
    if "search_id" in runs:
        runs = runs[runs["search_id"].isna()]
    runs = runs[runs["status"] == "ok"]
    if runs.empty:
        raise ConfigError("no successful runs in the given records; run `autosp bench ... --out FILE` first")
    if CPU_TIME_MEDIAN not in runs:  # records from before CPU time was recorded
        runs = runs.assign(**{CPU_TIME_MEDIAN: float("nan")})
    if "method_spec" in runs:  # a method run with its own options (`autosp[tiling=off]`) is a row of its own
        runs = runs.assign(method=runs["method_spec"].fillna(runs["method"]))
    keys = THROUGHPUT_GROUP + ["method"]
    table = (
        runs.groupby(keys, dropna=False)
        .agg(
            repeats=(ITER_TIME_MEDIAN, "size"),
            iter_time_s=(ITER_TIME_MEDIAN, "median"),
            iter_time_min_s=(ITER_TIME_MEDIAN, "min"),
            iter_time_max_s=(ITER_TIME_MEDIAN, "max"),
            tokens_per_s=("tokens_per_s", "median"),
            peak_mem_bytes=("peak_mem_bytes", "max"),
            cpu_time_s=(CPU_TIME_MEDIAN, "median"),
            cpu_time_min_s=(CPU_TIME_MEDIAN, "min"),
            cpu_time_max_s=(CPU_TIME_MEDIAN, "max"),
        )
        .reset_index()
    )
    if reference is not None:
        table[f"speed_vs_{reference}"] = 1.0 / _ratio_to(table, THROUGHPUT_GROUP, "iter_time_s", reference)
        # the same ratio in CPU seconds per step: the one to read on a machine shared with other jobs
        table[f"cpu_speed_vs_{reference}"] = 1.0 / _ratio_to(table, THROUGHPUT_GROUP, "cpu_time_s", reference)
        # differs from the iteration-speed ratio for data-parallel methods, which train dp_size sequences per step
        table[f"tokens_per_s_vs_{reference}"] = _ratio_to(table, THROUGHPUT_GROUP, "tokens_per_s", reference)
    return table.sort_values(keys).reset_index(drop=True)


def load_checks(paths: list[str]) -> pd.DataFrame:
    """Gradient checks (`autosp check --json-out`) as (model, world_size, method, gradient_check, worst_grad_error)."""
    import json

    rows = []
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        worst = (report.get("worst_grad") or {}).get("error")
        if report.get("status") != "ok":
            verdict = f"not run ({report.get('status')}: {report.get('error')})"
        else:
            verdict = f"{'PASSED' if report['passed'] else 'FAILED'} (worst gradient error {worst:.1e}, " \
                      f"tolerance {report['tolerance']:.0e})"
        rows.append({"model": report.get("model"), "world_size": report["world_size"], "method": report["method"],
                     "gradient_check": verdict, "worst_grad_error": worst})
    return pd.DataFrame(rows, columns=["model", "world_size", "method", "gradient_check", "worst_grad_error"])


def memory_table(records: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Saved-for-backward bytes per rank by operator category per method (`autosp activations` records), and
    each method's reduction against `baseline` (baseline bytes / method bytes, the paper's "13.03x" form)."""
    from autosp.experiments.activations import CATEGORIES, UNATTRIBUTED, method_label

    runs = records[records["kind"] == "activations"] if "kind" in records else records.iloc[0:0]
    if runs.empty:
        raise ConfigError("no activation records in the given files; run `autosp activations ... --out FILE` first")
    labels = [method_label(m, s) for m, s in zip(runs["method"], runs["sac"], strict=True)]
    runs = _latest(runs.assign(label=labels), ["label"])
    rows = []
    for _, run in runs.iterrows():
        row = {"method": run["label"], "model": run["model"], "seq_len": run["seq_len"],
               "world_size": run["world_size"], "status": run["status"], "error": run["error"]}
        for category in (*CATEGORIES, UNATTRIBUTED):
            row[f"{category}_bytes"] = run.get(f"extra.saved_by_category.{category}")
        row["total_bytes"] = run.get("extra.saved_activation_bytes")
        rows.append(row)
    table = pd.DataFrame(rows)
    if baseline not in set(table["method"]):
        raise ConfigError(
            f"memory baseline {baseline!r} is not among the methods measured: {', '.join(table['method'])}")
    base = table.set_index("method").loc[baseline]
    for category in ("attention", "mlp", "total"):
        column = f"{category}_bytes"
        table[f"{category}_reduction"] = pd.to_numeric(base[column]) / pd.to_numeric(table[column]).astype(float)
    return table.reset_index(drop=True)


def sac_table(records: pd.DataFrame, reference: str = "off") -> pd.DataFrame:
    """Per SAC policy of autosp: max trainable length (search rows) and median step time (bench runs), and
    both against policy `reference`: length gain (x) and time overhead (fraction; the paper's ~7% / 1.66x)."""
    searches = search_rows(records)
    runs = records[(records.get("kind").isna() if "kind" in records else True) & (records["status"] == "ok")]
    if "search_id" in runs:
        runs = runs[runs["search_id"].isna()]
    if searches.empty and runs.empty:
        raise ConfigError("no SAC search or bench records in the given files")
    lengths = _latest(searches, ["sac"]).set_index("sac") if not searches.empty else pd.DataFrame()
    times = runs.groupby("sac").agg(seq_len=("seq_len", "first"), repeats=(ITER_TIME_MEDIAN, "size"),
                                    iter_time_s=(ITER_TIME_MEDIAN, "median"),
                                    iter_time_min_s=(ITER_TIME_MEDIAN, "min"),
                                    iter_time_max_s=(ITER_TIME_MEDIAN, "max")) if not runs.empty else pd.DataFrame()
    policies = list(dict.fromkeys([*lengths.index, *times.index]))
    table = pd.DataFrame({"policy": policies})
    table["model"] = [(lengths.get("model", pd.Series(dtype=object)).get(p)) for p in policies]
    table["search_status"] = [lengths["status"].get(p) if "status" in lengths else None for p in policies]
    table["max_seq_len"] = [lengths["max_seq_len"].get(p) if "max_seq_len" in lengths else None for p in policies]
    for column in ("seq_len", "repeats", "iter_time_s", "iter_time_min_s", "iter_time_max_s"):
        table[column] = [times[column].get(p) if column in times else None for p in policies]
    ref = table.set_index("policy")
    if reference in ref.index:
        table["length_gain"] = pd.to_numeric(table["max_seq_len"]) / pd.to_numeric(ref.loc[reference, "max_seq_len"])
        table["time_overhead"] = (pd.to_numeric(table["iter_time_s"])
                                  / pd.to_numeric(ref.loc[reference, "iter_time_s"]) - 1.0)
    table["max_seq_len"] = table["max_seq_len"].astype("Int64")
    return table


def markdown(table: pd.DataFrame) -> str:
    """A GitHub Markdown table (numbers to 4 significant digits, empty cells for missing values)."""
    def cell(value: object) -> str:
        if value is None or (isinstance(value, float) and pd.isna(value)) or value is pd.NA:
            return ""
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(str, table.columns)) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def latex(table: pd.DataFrame) -> str:
    """A LaTeX booktabs tabular (\\usepackage{booktabs}), special characters escaped."""
    shown = table.astype(object).where(table.notna(), "")
    shown = shown.map(lambda v: f"{v:.4g}" if isinstance(v, float) else str(v))
    shown.columns = [str(c) for c in table.columns]
    return shown.style.hide(axis="index").to_latex(hrules=True, column_format="l" * len(shown.columns)).replace(
        "_", "\\_").replace("%", "\\%").replace("#", "\\#")


def write_table_files(table: pd.DataFrame, csv_path: str | Path) -> list[Path]:
    """The table as CSV at `csv_path` and, beside it, Markdown (.md) and LaTeX booktabs (.tex); all atomic."""
    csv_path = Path(csv_path)
    write_csv_atomic(table, csv_path)
    written = [csv_path]
    for suffix, text in ((".md", markdown(table)), (".tex", latex(table))):
        path = csv_path.with_suffix(suffix)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
        written.append(path)
    return written


def write_csv_atomic(table: pd.DataFrame, path: str | Path) -> None:
    """Write a table so a reader (or an interrupted workflow) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    table.to_csv(tmp, index=False)
    tmp.replace(path)


def format_table(table: pd.DataFrame) -> str:
    """The table as aligned text: budgets in binary units, ratios to 3 significant digits."""
    from autosp.harness.measure import format_size

    shown = table.copy()
    if "memory_budget" in shown:
        shown["memory_budget"] = [format_size(b) if pd.notna(b) else "device" for b in shown["memory_budget"]]
    if "peak_bytes_per_token" in shown:
        shown["peak_bytes_per_token"] = [format_size(b) if pd.notna(b) else "" for b in shown["peak_bytes_per_token"]]
    with pd.option_context("display.width", 250, "display.max_columns", None, "display.float_format", "{:.3g}".format):
        return shown.to_string(index=False)


def add_records_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """--in and --skip-bad-lines: the record files a reporting command reads (`table`, `plot`)."""
    parser.add_argument("--in", dest="inputs", nargs="+", required=required, help="JSONL record files")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="leave out lines that are not records (each one reported) instead of failing")


def records_from_args(args: argparse.Namespace) -> pd.DataFrame:
    """The records `add_records_arguments` names; skipped lines are reported on stderr, one line each."""
    from autosp.harness.records import load_records

    records = load_records(args.inputs, skip_bad_lines=args.skip_bad_lines)
    for problem in records.attrs["skipped_lines"]:
        print(f"skipped {problem}", file=sys.stderr)
    return records


def _trainability_inputs(args: argparse.Namespace) -> pd.DataFrame:
    """The trainability table of `--in`: search records (JSONL) and `autosp simulate-table` tables (.md) alike."""
    tables = [trainability_table(simulated_table_rows(path)) for path in args.inputs if str(path).endswith(".md")]
    records = [path for path in args.inputs if not str(path).endswith(".md")]
    if records:
        args_records = argparse.Namespace(inputs=records, skip_bad_lines=args.skip_bad_lines)
        tables.append(trainability_table(records_from_args(args_records)))
    return pd.concat(tables, ignore_index=True)


def _cmd_table(args: argparse.Namespace) -> int:
    from autosp.harness.records import check_writable

    if args.out:
        check_writable(args.out)
    if args.kind == "peers":  # published numbers, and ours beside them where --in gives records
        table = peers_table(records_from_args(args) if args.inputs else None)
        print(format_table(table))
        if args.out:
            write_table_files(table, args.out)
        return 0
    if not args.inputs:
        raise ConfigError(f"autosp table {args.kind} needs --in FILES (the records to tabulate)")
    if args.kind == "headline":
        table = headline_table(_trainability_inputs(args), args.devices.split(",") if args.devices else None)
        print(markdown(table), end="")
        if args.out:
            write_table_files(table, args.out)
        return 0
    records = records_from_args(args)
    if args.kind == "alst":
        table = alst_table(records)
    elif args.kind == "trainability":
        table = trainability_table(records, checks=load_checks(args.checks) if args.checks else None)
    elif args.kind == "memory":
        table = memory_table(records, baseline=args.baseline)
    elif args.kind == "sac":
        table = sac_table(records)
    else:
        table = throughput_table(records, reference=args.ratio_to or None)
    print(format_table(table))
    if args.out:
        write_table_files(table, args.out)
    return 0


def add_table_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp table trainability|throughput|memory|sac|headline|alst --in FILES... [--out table.csv]`; `autosp
    table peers`: the published peers' lengths and throughput, each with its source."""
    p = subparsers.add_parser("table",
                              help="tables (trainability, throughput, memory, sac, headline, alst) from records",
                              epilog="headline: --in takes search records (.jsonl) and `autosp simulate-table` "
                                     "tables (.md) together, e.g. --in results/simulated_table.md; alst: ALST's "
                                     "published lengths (arXiv 2506.13996) beside the alst records; peers: every "
                                     "published peer anchor (ALST, UPipe, torchtitan) with its source, no --in")
    p.add_argument("kind", choices=["trainability", "throughput", "memory", "sac", "headline", "alst", "peers"])
    add_records_arguments(p, required=False)
    p.add_argument("--out", help="write the table as CSV here, and as Markdown (.md) and LaTeX (.tex) beside it")
    p.add_argument("--ratio-to", default="ulysses", help="throughput: reference method for the speed ratio")
    p.add_argument("--checks", nargs="*", default=[], help="trainability: `autosp check --json-out` reports to show")
    p.add_argument("--baseline", default="single", help="memory: the method reductions are taken against")
    p.add_argument("--devices", default="", help="headline: comma-separated device types to show (default: all)")
    p.set_defaults(func=_cmd_table)
