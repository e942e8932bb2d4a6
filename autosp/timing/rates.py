"""Sustained rates of a device type, per op class, from `autosp/reference/device_rates.csv`.

Each GPU row is a datasheet peak times a sustained fraction, both cited in the row's `source` (the fractions are
the low end or middle of a published range, or a stated assumption: never fitted to a measured step). The `cpu`
row is measured on this machine by `autosp calibrate` (`write_cpu_rates`), as P ranks of a CPU run see it.

- matmul / attention: FLOP/s of dense matmuls and of fused attention kernels (forward and backward alike);
- attention by key length (`attention_by_keys`, "1024:0.61 2048:0.75": the attention fraction at each measured key
  length; between two, linear in log2 of the length, beyond the ends the end's): a kernel's efficiency grows with its
  keys (measured on the cpu row by `autosp calibrate`: a CPU flash kernel's fixed work per block of queries weighs
  more at fewer keys); empty: one fraction at every length (the GPU rows: not measured);
- memory: bytes/s of memory-bound ops (read + written) at the HBM's sustained rate;
- peer / node: bytes/s each way between two GPUs of a node and per GPU across nodes (collectives);
- host link: bytes/s each way between the device and host memory (offload copies, on their own stream);
- host memory: bytes/s of the host's memory one rank's share of the CPUs moves (the host optimizer step);
- collective latency: seconds per collective call (measured on the cpu row; 0 on the GPU rows: not modelled);
- collective wait: the wait for the slower rank at a collective after `WAIT_STRETCH_S` of the rank's own work since
  the previous collective; it grows with the square root of that work (the ranks' timing noise accumulates like a
  random walk: docs/measurements/2026-12-07-collective-waits.md; measured on the cpu row, at its calibration's rank
  count; 0 on the GPU rows: not measured);
- collectives by bytes: a collective's seconds by kind at the bytes one rank sends, measured in a tight loop (the cpu
  row: gloo's all-reduce and reduce-scatter cost 1.6-4x an all-gather of the same bytes at 8-512 KiB, and its large
  transfers run 2-3x the rate of the peer column's 32 MiB gather: docs/measurements/2026-12-07-collectives-by-bytes.md);
  where a row has them, they price those kinds in place of latency + bytes / peer, interpolated linearly in the bytes,
  the smallest's time below it and the largest's rate above it; empty on the GPU rows: not measured;
- op overhead: seconds every op costs besides its work (the dispatch of one op on a CPU thread, measured on the
  cpu row; 0 on the GPU rows, whose kernels are launched ahead of the stream: not modelled);
- ZeRO-3 hook: host seconds of one call of DeepSpeed ZeRO-3's parameter coordinator (a module's hook fetching its
  parameters before it runs, forward or backward, or releasing them after: Python on the rank's thread, beyond the
  collectives it starts, which are priced as collectives; measured per call on the cpu row; 0 on the GPU rows: not
  measured on a GPU host);
- streams: whether copies and collectives run beside compute (GPU streams) or in line (one CPU thread).
"""
from __future__ import annotations

import csv
import io
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from autosp.errors import AutoSPError

RATES_FILE = "device_rates.csv"
#: the work before a collective at which a row's `collective_wait_us` is stated (module docstring)
WAIT_STRETCH_S = 1e-3
COLUMNS = ("device", "peak_tflops", "matmul_fraction", "attention_fraction", "attention_by_keys", "hbm_gb_s",
           "hbm_fraction", "peer_gb_s", "node_gb_s", "host_link_gb_s", "host_memory_gb_s", "collective_latency_us",
           "collective_wait_us", "collective_by_bytes", "op_overhead_us", "zero3_hook_us", "streams", "source")
#: the collective kinds a row's `collective_by_bytes` may state (`collective_bytes` knows each)
MEASURED_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


class RatesError(AutoSPError):
    """A device type without rates (the cpu row before `autosp calibrate`), or an unknown one."""


@dataclass(frozen=True)
class DeviceRates:
    """One device type's sustained rates (per second) and what MFU is counted against (`peak_flops`)."""

    name: str
    peak_flops: float
    matmul_flops: float
    attention_flops: float
    memory_bytes_s: float
    peer_bytes_s: float
    node_bytes_s: float
    host_link_bytes_s: float
    host_memory_bytes_s: float
    collective_latency_s: float
    streams: bool
    op_overhead_s: float = 0.0
    zero3_hook_s: float = 0.0
    collective_wait_s: float = 0.0
    attention_by_keys: tuple[tuple[int, float], ...] = ()  # (key length, FLOP/s), ascending
    #: (kind, ((bytes one rank sends, seconds), ...) ascending) for the kinds the row measured (module docstring)
    collective_by_bytes: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    source: str = ""

    def matmul_seconds(self, flops: float) -> float:
        return flops / self.matmul_flops

    def attention_seconds(self, flops: float, keys: int = 0) -> float:
        """An attention kernel's `flops` over `keys` keys: at the rate of that key length where the row measured
        rates by length (module docstring), else at the one attention rate."""
        return flops / self.attention_rate(keys)

    def attention_rate(self, keys: int) -> float:
        table = self.attention_by_keys
        if not table or keys <= 0:
            return self.attention_flops
        if keys <= table[0][0]:
            return table[0][1]
        for (low, low_rate), (high, high_rate) in itertools.pairwise(table):
            if keys <= high:
                share = (math.log2(keys) - math.log2(low)) / (math.log2(high) - math.log2(low))
                return low_rate + share * (high_rate - low_rate)
        return table[-1][1]

    def memory_seconds(self, nbytes: float) -> float:
        return nbytes / self.memory_bytes_s

    def copy_seconds(self, nbytes: float) -> float:
        """One device <-> host copy of `nbytes`."""
        return nbytes / self.host_link_bytes_s

    def host_seconds(self, nbytes: float) -> float:
        """Host-side work moving `nbytes` through host memory (the host optimizer step)."""
        return nbytes / self.host_memory_bytes_s

    def zero3_hook_seconds(self, calls: float) -> float:
        """The host work of `calls` calls of DeepSpeed ZeRO-3's parameter coordinator (a module's hook fetching or
        releasing its parameters; the gathers they start are priced apart, as collectives)."""
        return calls * self.zero3_hook_s

    def rank_wait_seconds(self, work_s: float) -> float:
        """The wait for the slower rank at a collective that follows `work_s` seconds of this rank's work since the
        previous collective (module docstring)."""
        return self.collective_wait_s * math.sqrt(max(work_s, 0.0) / WAIT_STRETCH_S)

    def collective_seconds(self, kind: str, nbytes: float, group_size: int, gpus_per_node: int) -> float:
        """A ring collective of `kind` over `group_size` ranks on a tensor of `nbytes` (`collective_bytes`): the
        bytes each rank sends at the slowest link the group spans, plus the per-call latency."""
        if group_size <= 1:
            return 0.0
        sent = collective_bytes(kind, nbytes, group_size)
        measured = dict(self.collective_by_bytes).get(kind)
        if measured and group_size <= gpus_per_node:
            return _interpolated(measured, sent)
        link = self.peer_bytes_s if group_size <= gpus_per_node else self.node_bytes_s
        return self.collective_latency_s + sent / link


def _interpolated(points: tuple[tuple[float, float], ...], sent: float) -> float:
    """Seconds at `sent` bytes from ascending (bytes, seconds) points: linear between two, the smallest's seconds
    below them, the largest's rate (seconds per byte) above them."""
    if sent <= points[0][0]:
        return points[0][1]
    for (low, low_s), (high, high_s) in itertools.pairwise(points):
        if sent <= high:
            return low_s + (sent - low) / (high - low) * (high_s - low_s)
    largest, largest_s = points[-1]
    return largest_s * sent / largest


def collective_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring collective on a tensor of `nbytes` (the whole, unsharded tensor):
    all-gather, reduce-scatter and all-to-all send (P-1)/P of it, all-reduce twice that, a broadcast all of it."""
    share = (group_size - 1) / group_size
    factors = {"all_gather": share, "reduce_scatter": share, "all_to_all": share, "all_reduce": 2 * share,
               "broadcast": 1.0}
    if kind not in factors:
        raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(factors)}")
    return factors[kind] * nbytes


def _package_file() -> Path:
    return Path(str(resources.files("autosp.reference").joinpath(RATES_FILE)))


@lru_cache(maxsize=1)
def rates_catalogue() -> dict[str, dict[str, str]]:
    """The catalogue's rows by device type, as written (`device_rates` turns one into rates)."""
    text = _package_file().read_text(encoding="utf-8")
    return {row["device"]: row for row in csv.DictReader(io.StringIO(text))}


#: other names users write for a catalogue entry (as the memory catalogue's)
ALIASES = {"mi250": "mi250-gcd", "mi250x": "mi250-gcd", "gh200": "gh200-96gb", "h200": "h200-141gb"}


def device_rates(name: str) -> DeviceRates:
    """The rates of device type `name`; a one-line error where the catalogue has none."""
    rows = rates_catalogue()
    row = rows.get(ALIASES.get(name, name))
    if row is None:
        raise RatesError(f"no rates for device {name!r} in {RATES_FILE}; one of: {', '.join(rows)}")
    if not row["peak_tflops"]:
        raise RatesError(f"device {name!r} has no measured rates yet: run `autosp calibrate` once on this machine")
    g = 1e9

    def num(column: str) -> float:
        return float(row[column])

    peak = num("peak_tflops") * 1e12

    return DeviceRates(
        name=row["device"], peak_flops=num("peak_tflops") * 1e12,
        matmul_flops=num("peak_tflops") * 1e12 * num("matmul_fraction"),
        attention_flops=num("peak_tflops") * 1e12 * num("attention_fraction"),
        memory_bytes_s=num("hbm_gb_s") * g * num("hbm_fraction"), peer_bytes_s=num("peer_gb_s") * g,
        node_bytes_s=num("node_gb_s") * g, host_link_bytes_s=num("host_link_gb_s") * g,
        host_memory_bytes_s=num("host_memory_gb_s") * g, collective_latency_s=num("collective_latency_us") * 1e-6,
        collective_wait_s=num("collective_wait_us") * 1e-6, op_overhead_s=num("op_overhead_us") * 1e-6,
        zero3_hook_s=num("zero3_hook_us") * 1e-6,
        attention_by_keys=tuple((keys, peak * fraction) for keys, fraction in parse_by_keys(row, name)),
        collective_by_bytes=parse_collectives(row, name),
        streams=bool(int(row["streams"])), source=row["source"])


def parse_by_keys(row: dict[str, str], name: str) -> list[tuple[int, float]]:
    """The row's `attention_by_keys` as ascending (key length, fraction) pairs; a one-line error if malformed."""
    text = (row.get("attention_by_keys") or "").strip()
    try:
        pairs = sorted((int(keys), float(fraction)) for keys, fraction in (p.split(":") for p in text.split()))
    except ValueError:
        raise RatesError(f"{RATES_FILE}: {name}'s attention_by_keys {text!r} is not 'keys:fraction ...' "
                         "(e.g. '1024:0.6 2048:0.75')") from None
    if any(keys <= 0 or fraction <= 0 for keys, fraction in pairs):
        raise RatesError(f"{RATES_FILE}: {name}'s attention_by_keys {text!r} has a length or fraction <= 0")
    return pairs


def parse_collectives(row: dict[str, str], name: str) -> tuple[tuple[str, tuple[tuple[float, float], ...]], ...]:
    """The row's `collective_by_bytes` ('kind:bytes:us ...') as (kind, ascending (bytes, seconds)) pairs; a one-line
    error if malformed."""
    text = (row.get("collective_by_bytes") or "").strip()
    by_kind: dict[str, list[tuple[float, float]]] = {}
    try:
        for item in text.split():
            kind, nbytes, us = item.split(":")
            by_kind.setdefault(kind, []).append((float(nbytes), float(us) * 1e-6))
    except ValueError:
        raise RatesError(f"{RATES_FILE}: {name}'s collective_by_bytes {text!r} is not 'kind:bytes:us ...' "
                         "(e.g. 'all_reduce:4:250 all_reduce:65536:900')") from None
    unknown = sorted(set(by_kind) - set(MEASURED_COLLECTIVES))
    if unknown:
        raise RatesError(f"{RATES_FILE}: {name}'s collective_by_bytes names {', '.join(unknown)}; "
                         f"one of {', '.join(MEASURED_COLLECTIVES)}")
    if any(nbytes < 0 or seconds <= 0 for points in by_kind.values() for nbytes, seconds in points):
        raise RatesError(f"{RATES_FILE}: {name}'s collective_by_bytes {text!r} has bytes < 0 or a time <= 0")
    if any(len({nbytes for nbytes, _ in points}) < len(points) for points in by_kind.values()):
        raise RatesError(f"{RATES_FILE}: {name}'s collective_by_bytes {text!r} states one kind twice at one size")
    return tuple((kind, tuple(sorted(points))) for kind, points in by_kind.items())


def write_cpu_rates(row: dict[str, str], path: Path | None = None) -> Path:
    """Replace the `cpu` row of the catalogue (the package's file unless `path`; a new `path` gets the package's
    other rows) with a measured one; a one-line error where `path` has another set of columns (an older autosp's)."""
    path = path or _package_file()
    source = path if path.exists() else _package_file()  # a new file starts from the package's rows
    reader = csv.DictReader(io.StringIO(source.read_text(encoding="utf-8")))
    if tuple(reader.fieldnames or ()) != COLUMNS:
        raise RatesError(f"{source} does not have this autosp's rate columns ({', '.join(COLUMNS)}): "
                         "write the calibration to a new file (--out) or remove that one")
    rows = {r["device"]: r for r in reader}
    rows["cpu"] = {column: str(row.get(column, "")) for column in COLUMNS}
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows.values())
    path.write_text(out.getvalue(), encoding="utf-8")
    rates_catalogue.cache_clear()
    return path
