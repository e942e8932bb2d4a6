"""Device catalogue and allocator model for `autosp simulate`: what a predicted per-rank peak costs on a device.

The simulator counts live tensor storage bytes; a GPU holds more than that. Per device
(`autosp/reference/device_memory.csv`, read with importlib.resources so a clone alone has it):

- ``memory_gib`` x ``usable_fraction``: the bytes the driver lets a process have (part of the nominal HBM is
  reserved by the driver/ECC; 0.98 is a documented assumption, the same for every GPU, not fitted);
- block rounding of PyTorch's caching allocator (CUDA and ROCm share it through hipify): every request is
  rounded up to ``small_block_bytes`` (kMinBlockSize, 512 B), and a request above 1 MiB (kSmallSize) is served
  from the large pool, whose segments are multiples of ``large_block_bytes`` (kRoundLarge, 2 MiB). Caching
  fragmentation is modelled as exactly that segment rounding of large blocks: nothing else is added;
- ``context_mib``: the CUDA/ROCm context with PyTorch's kernels lazily loaded. Hopper rows (h100, h200, gh200):
  733 MiB, read on an H200 with `tests/gpu/context_probe.py` (docs/measurements/2026-12-01-simulator.md). Other
  rows: 500 MiB, a documented order of magnitude for CUDA 12 / ROCm 6 with lazy module loading (not measured).
  Neither is fitted to any paper number;
- ``workspace_mib``: the BLAS library workspace torch allocates per handle (cuBLAS: 8 MiB before Hopper,
  32 MiB on Hopper; hipBLASLt alike), outside the tensor allocator statistics;
- ``host_gib_per_node``: the host memory of one node of such GPUs (vendor figures, each cited in ``host_source``;
  a DIMM's or LPDDR package's "GB" is binary, so 2 TB is 2048 GiB), the bound of what the node's ranks offload
  (`autosp.harness.measure.node_host_bytes`); empty where no figure is cited (then only --host-memory-budget
  bounds it).

The ``cpu`` device is the validation device: what `autosp run`'s CPU meter (profiler replay of the CPU
allocator) counts — live tensor bytes, no rounding, no context; its size is the run's --memory-budget.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from autosp.harness.config import ConfigError

GIB = 1 << 30
MIB = 1 << 20
#: requests above this come from the caching allocator's large pool (kSmallSize)
LARGE_REQUEST_BYTES = 1 << 20


@dataclass(frozen=True)
class DeviceModel:
    """One device type: its memory and the allocator/context terms a simulated peak is charged with."""

    name: str
    vendor: str
    memory_bytes: int
    usable_fraction: float
    small_block_bytes: int
    large_block_bytes: int
    context_bytes: int
    workspace_bytes: int
    gpus_per_node: int
    note: str = ""
    host_bytes_per_node: int | None = None  # None: no cited figure (only --host-memory-budget bounds the host)

    @property
    def usable_bytes(self) -> int:
        """Bytes the training process can hold: the usable part of the memory."""
        return int(self.memory_bytes * self.usable_fraction)

    @property
    def fixed_bytes(self) -> int:
        """Memory taken before any tensor: context and library workspaces."""
        return self.context_bytes + self.workspace_bytes

    def ranks_per_node(self, world_size: int) -> int:
        """Ranks of a `world_size` job on one node: every rank of a CPU run is on this machine."""
        return world_size if self.vendor == "cpu" else min(world_size, self.gpus_per_node)

    def block_bytes(self, nbytes: int) -> int:
        """What the allocator reserves for one storage of `nbytes` (see the module docstring)."""
        if nbytes <= 0:
            return 0
        block = self.large_block_bytes if nbytes > LARGE_REQUEST_BYTES else self.small_block_bytes
        return -(-nbytes // block) * block

    def with_budget(self, budget_bytes: int) -> "DeviceModel":
        """This device with its memory set to `budget_bytes` (the cpu device's --memory-budget)."""
        from dataclasses import replace

        return replace(self, memory_bytes=budget_bytes, usable_fraction=1.0)


@lru_cache(maxsize=1)
def device_catalogue() -> dict[str, DeviceModel]:
    text = resources.files("autosp.reference").joinpath("device_memory.csv").read_text(encoding="utf-8")
    devices = {}
    for row in csv.DictReader(io.StringIO(text)):
        devices[row["device"]] = DeviceModel(
            name=row["device"], vendor=row["vendor"], memory_bytes=int(float(row["memory_gib"]) * GIB),
            usable_fraction=float(row["usable_fraction"]), small_block_bytes=int(row["small_block_bytes"]),
            large_block_bytes=int(row["large_block_bytes"]), context_bytes=int(float(row["context_mib"]) * MIB),
            workspace_bytes=int(float(row["workspace_mib"]) * MIB), gpus_per_node=int(row["gpus_per_node"]),
            note=row["note"],
            host_bytes_per_node=int(float(row["host_gib_per_node"]) * GIB) if row["host_gib_per_node"] else None)
    return devices


#: other names users write for a catalogue entry
ALIASES = {"mi250": "mi250-gcd", "mi250x": "mi250-gcd", "gh200": "gh200-96gb", "h200": "h200-141gb"}


def get_device_model(name: str, memory_budget: int | None = None) -> DeviceModel:
    """The catalogue entry `name`; `memory_budget` (bytes) replaces its memory (required for `cpu`)."""
    devices = device_catalogue()
    device = devices.get(ALIASES.get(name, name))
    if device is None:
        raise ConfigError(f"unknown --device {name!r} for simulation; choose one of: {', '.join(devices)}")
    if memory_budget is not None:
        return device.with_budget(memory_budget)
    if device.memory_bytes == 0:
        raise ConfigError(f"--device {name} has no memory of its own; give --memory-budget (e.g. 64MiB)")
    return device
