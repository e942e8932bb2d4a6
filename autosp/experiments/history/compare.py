"""Did this commit make a method slower, or shorten the longest sequence it trains? Answered from the store.

One timing answers nothing on a shared machine, so every throughput series is compared on its raw samples:
the change of the median with a bootstrap confidence interval, and a Mann-Whitney U test (both SciPy). A
series regresses only when it got worse by more than the threshold *and* the test says the samples differ;
with too few samples for the test to ever reach significance the verdict says so instead of guessing. A
series whose repeated runs agree exactly on both sides (CPU peak memory is deterministic) has no noise to
test against: its change counts when it is beyond the threshold.
Trainability is deterministic under an (emulated) memory budget and compared exactly: a lower max length,
or a length that trained at the base and runs out of memory at the head, is a regression at any size.

Samples are only ever compared within one machine (device, device_name): a commit measured on another
device is listed as not comparable, never compared.
"""
from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from autosp.experiments.history.store import (
    DEFAULT_ALPHA,
    MACHINE_KEY,
    SERIES_KEY,
    TRAINABILITY_METRICS,
    _git,
    higher_is_better,
    repo_root,
)
from autosp.harness.config import ConfigError

REGRESSION, IMPROVEMENT, UNCHANGED, TOO_FEW = "REGRESSION", "improvement", "unchanged", "too few samples"


@dataclass(frozen=True)
class Point:
    """One measured state of the code: a commit, and whether its checkout had uncommitted changes."""

    commit: str
    dirty: bool

    @property
    def label(self) -> str:
        return self.commit[:9] + ("+dirty" if self.dirty else "")


def with_points(history: pd.DataFrame) -> pd.DataFrame:
    """`history` with a `point` label column, rows ordered by commit time (then by when they were recorded)."""
    if history.empty:
        raise ConfigError("the history store holds no samples; record results first")
    df = history.dropna(subset=["commit_sha"]).copy()
    df["dirty"] = df["dirty"].fillna(0).astype(bool)
    df["point"] = [Point(c, d).label for c, d in zip(df["commit_sha"], df["dirty"])]
    df["machine"] = df[list(MACHINE_KEY)].fillna("?").astype(str).agg(" / ".join, axis=1)
    key = df[list(SERIES_KEY)].astype(object).where(df[list(SERIES_KEY)].notna(), None)
    df["series"] = [repr(tuple(row)) for row in key.itertuples(index=False)]  # NaN-free, hashable group key
    first_seen = df.groupby("point")["row"].transform("min")
    return df.assign(_first=first_seen).sort_values(["commit_time", "_first", "row"]).drop(columns="_first")


def ordered_points(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["point"]))


def resolve(rev: str, df: pd.DataFrame) -> str:
    """The recorded point a revision names: any git revision (HEAD~2, a branch, a sha) or a recorded sha
    prefix; `REV+dirty` picks the dirty measurements of that commit."""
    want_dirty = rev.endswith("+dirty")
    rev = rev.removesuffix("+dirty")
    sha = _git(repo_root(), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    recorded = df.drop_duplicates("point")
    matches = recorded[recorded["commit_sha"] == sha] if sha else recorded.iloc[0:0]
    if matches.empty:
        matches = recorded[recorded["commit_sha"].str.startswith(rev.lower())]
    if matches.empty:
        raise ConfigError(f"no recorded measurements of {rev!r}; `autosp history list` shows the recorded commits")
    if matches["commit_sha"].nunique() > 1:
        raise ConfigError(f"{rev!r} matches several recorded commits; give more of the sha")
    preferred = matches[matches["dirty"] == want_dirty]
    return (preferred if not preferred.empty else matches)["point"].iloc[0]


def _p_value(base: np.ndarray, head: np.ndarray) -> float:
    if np.ptp(np.concatenate([base, head])) == 0:
        return 1.0  # every sample equal: nothing differs (the test's variance would be zero)
    return float(stats.mannwhitneyu(base, head, alternative="two-sided").pvalue)


def _smallest_p(n: int, m: int) -> float:
    """The smallest two-sided p-value an exact Mann-Whitney test can give with n and m samples."""
    return min(1.0, 2 / math.comb(n + m, n))


def _change_interval(base: np.ndarray, head: np.ndarray) -> tuple[float, float]:
    """95% bootstrap interval of the relative change of the median (NaN when either side has one sample)."""
    if len(base) < 2 or len(head) < 2:
        return math.nan, math.nan

    def change(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.median(b, axis=axis) / np.median(a, axis=axis) - 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a degenerate resample (all equal) warns and gives NaN: fine
        result = stats.bootstrap((base, head), change, vectorized=True, n_resamples=2000, method="percentile",
                                 confidence_level=0.95, rng=np.random.default_rng(0))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def compare_samples(metric: str, base: np.ndarray, head: np.ndarray, *, threshold: float,
                    alpha: float = DEFAULT_ALPHA) -> dict:
    """The change of one series between two points and its verdict."""
    if metric in TRAINABILITY_METRICS:  # deterministic under a budget: exact comparison
        b, h = float(np.max(base)), float(np.max(head))
        verdict = REGRESSION if h < b else IMPROVEMENT if h > b else UNCHANGED
        return {"base": b, "head": h, "change": (h / b - 1) if b else math.nan, "ci_low": math.nan,
                "ci_high": math.nan, "p_value": math.nan, "verdict": verdict}
    b, h = float(np.median(base)), float(np.median(head))
    change = h / b - 1
    worse_by = -change if higher_is_better(metric) else change
    low, high = _change_interval(base, head)
    p = _p_value(base, head)
    exact = min(len(base), len(head)) > 1 and np.ptp(base) == 0 and np.ptp(head) == 0
    if abs(change) <= threshold:
        verdict = UNCHANGED
    elif exact:  # repeated runs agree to the byte (CPU peak memory): no noise to test against
        verdict = REGRESSION if worse_by > 0 else IMPROVEMENT
    elif _smallest_p(len(base), len(head)) >= alpha:
        verdict = TOO_FEW
    elif p >= alpha:
        verdict = UNCHANGED
    else:
        verdict = REGRESSION if worse_by > 0 else IMPROVEMENT
    return {"base": b, "head": h, "change": change, "ci_low": low, "ci_high": high, "p_value": p,
            "verdict": verdict}


_GROUP = ["machine", "series"]


def _describe(series: pd.DataFrame) -> dict:
    """The machine and the configuration fields of one series (from its first sample)."""
    first = series.iloc[0]
    return {"machine": first["machine"], **{c: first[c] for c in SERIES_KEY}}


def compare(history: pd.DataFrame, *, base: str | None = None, head: str | None = None, threshold: float = 0.05,
            alpha: float = DEFAULT_ALPHA) -> tuple[pd.DataFrame, dict]:
    """Every series measured at both points on the same machine, compared; plus what was left out and why.

    Default head: the latest recorded point. Default base: per machine of the head, the latest point before
    it measured on that machine. Returns (table, info) with info = {"head", "bases", "other_machines",
    "unmeasured"} (the last: machines of the head where the given base has no samples, so nothing was compared)."""
    df = with_points(history)
    points = ordered_points(df)
    head = resolve(head, df) if head else points[-1]
    head_rows = df[df["point"] == head]
    rows, bases, unmeasured = [], {}, []
    for machine, head_machine in head_rows.groupby("machine"):
        same_machine = df[df["machine"] == machine]
        if base:
            base_point = resolve(base, df)
            if base_point not in set(same_machine["point"]):
                unmeasured.append(f"{base_point} has no samples on {machine}")
                continue
        else:
            earlier = [p for p in ordered_points(same_machine) if points.index(p) < points.index(head)]
            if not earlier:
                continue
            base_point = earlier[-1]
        bases[machine] = base_point
        base_series = dict(iter(same_machine[same_machine["point"] == base_point].groupby(_GROUP)))
        for key, head_series in head_machine.groupby(_GROUP):
            if key not in base_series:
                continue
            values = _describe(head_series)
            result = compare_samples(values["metric"], base_series[key]["value"].to_numpy(float),
                                     head_series["value"].to_numpy(float), threshold=threshold, alpha=alpha)
            rows.append({**values, "n_base": len(base_series[key]), "n_head": len(head_series),
                         "kind": "trainability" if values["metric"] in TRAINABILITY_METRICS else "throughput",
                         **result})
    other_machines = sorted(set(df["machine"]) - set(head_rows["machine"]))
    table = pd.DataFrame(rows)
    return table, {"head": head, "bases": bases, "other_machines": other_machines, "unmeasured": unmeasured}


def bisect_hint(history: pd.DataFrame, *, threshold: float = 0.05, alpha: float = DEFAULT_ALPHA) -> pd.DataFrame:
    """Per series and machine, the first recorded point where it moved (regressed or improved) against the
    point measured before it, walking the points in commit order."""
    df = with_points(history)
    points = ordered_points(df)
    rows = []
    for _, series in df.groupby(_GROUP):
        values = _describe(series)
        by_point = dict(iter(series.groupby("point")))
        walk = [p for p in points if p in by_point]
        for before, after in itertools.pairwise(walk):
            result = compare_samples(values["metric"], by_point[before]["value"].to_numpy(float),
                                     by_point[after]["value"].to_numpy(float), threshold=threshold, alpha=alpha)
            if result["verdict"] in (REGRESSION, IMPROVEMENT):
                rows.append({**values, "moved_at": after, "previous": before, **result})
                break
    return pd.DataFrame(rows)


def series_label(row: pd.Series | dict) -> str:
    """`autosp tiny S=512 P=2 iter_time_s` (the fields that usually differ between series)."""
    parts = [str(row["method"]), str(row["model"])]
    seq_len = row.get("seq_len")
    if seq_len is not None and not (isinstance(seq_len, float) and math.isnan(seq_len)):
        parts.append(f"S={int(seq_len)}")
    parts.append(f"P={int(row['world_size'])}")
    zero = row.get("zero")
    if zero and not (isinstance(zero, float) and math.isnan(zero)):
        parts.append(f"zero{int(zero)}")
    if row.get("mode") not in (None, "measured"):
        parts.append(str(row["mode"]))
    return " ".join(parts) + f" {row['metric']}"


def format_table(table: pd.DataFrame) -> str:
    """A readable fixed-width table: series, medians, change with its 95% interval, p, verdict."""
    if table.empty:
        return "  (no series measured at both points)"

    def number(x: float) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"

    def percent(x: float) -> str:
        return "-" if x is None or math.isnan(x) else f"{x:+.1%}"

    shown = pd.DataFrame({
        "series": [series_label(r) for _, r in table.iterrows()],
        "n": [f"{b}/{h}" for b, h in zip(table["n_base"], table["n_head"])],
        "base": table["base"].map(number), "head": table["head"].map(number),
        "change": table["change"].map(percent),
        "95% CI": [f"[{percent(lo)}, {percent(hi)}]" if not math.isnan(lo) else "-"
                   for lo, hi in zip(table["ci_low"], table["ci_high"])],
        "p": table["p_value"].map(lambda p: "-" if math.isnan(p) else f"{p:.3g}"),
        "verdict": table["verdict"],
    })
    return shown.to_string(index=False)
