"""Step timing and per-rank peak memory, measured the same way for every method.

Memory, per device kind:
- CUDA / ROCm: the caching allocator's `max_memory_allocated` (and `max_memory_reserved`), reset right before
  the measured step and read after the timed steps, so it covers every steady-state step.
- CPU: there is no allocator statistic, and the resident set size is useless (torch, compiler and Python
  overhead; monotonic). We replay PyTorch's own CPU allocation accounting instead: the profiler with
  `profile_memory=True` records every allocation and free made through c10's CPU allocator with its size.
  The profiler runs from just before the model is built until the end of one full measured step
  (forward + backward + optimizer, after the warm-up steps), so the running sum of allocation sizes is the number
  of live tensor bytes this rank allocated — parameters, gradients, optimizer state, activations, temporaries,
  communication buffers. The reported peak is the maximum of that sum during the measured step (which starts
  with everything resident from setup and warm-up). The same program allocates the same sizes in the same
  order, so the number is identical across repeated runs.

  Communication threads: a collective's tensors are also referenced by its Work object, which
  torch.distributed's worker threads (gloo) release right after completing it. Whichever thread drops the last
  reference frees the tensor, and frees in those (unprofiled) threads are invisible, so the count would depend
  on thread timing. While the meter runs, every `Work.wait()` therefore lingers briefly (`SETTLE_S`) after the
  collective completes, so the worker has let go and the frees happen, visibly, in the training thread. This
  covers every wait issued from Python (dist.* calls, FSDP2, DeepSpeed, the autosp all-to-all op); a wait
  inside C++ (`_c10d_functional.wait_tensor` from traced functional collectives) is not covered.

  Covered: every tensor storage made through c10's CPU allocator, in eager, aot_eager and inductor code alike
  (inductor's generated wrappers allocate buffers with `empty_strided`, and reuse them, which is why fewer
  events show up under inductor: the memory is really not allocated). Not covered: memory allocated before
  the profiler starts (torch's import-time globals, process-group setup), memory outside the tensor allocator
  (Python objects, gloo transport buffers, oneDNN/MKL scratch space, stack buffers inside inductor's C++
  kernels, C++ extensions that call malloc directly, e.g. some DeepSpeed ops), and allocator overhead or
  fragmentation (the CPU allocator is malloc: no caching pool to report).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from autosp.compiler.fx import parse_size  # noqa: F401  (the harness's sizes are read here)

T = TypeVar("T")

def format_size(num_bytes: float | None, digits: int = 2) -> str:
    """Human-readable binary size, e.g. 1.50 GiB."""
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.{digits}f} {unit}"
        value /= 1024
    return f"{value:.{digits}f} TiB"


def format_sizes_apart(*sizes: float) -> list[str]:
    """format_size for sizes compared in one message: as many digits as it takes for different sizes to read
    differently (never "peak 4.24 MiB exceeds the budget 4.24 MiB"), exact bytes as the last resort."""
    for digits in (2, 4, 6):
        texts = [format_size(v, digits) for v in sizes]
        if len(set(texts)) == len(set(sizes)):
            return texts
    return [f"{int(v)} B" for v in sizes]


def ranks_on_this_node(device: torch.device) -> int:
    """The ranks sharing this rank's host memory: the launcher's LOCAL_WORLD_SIZE (torchrun's, the local launch's,
    the simulator's node of the device it simulates), else every rank on CPU (one machine) or the node's GPU
    count."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 1
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return dist.get_world_size() if device.type == "cpu" else torch.cuda.device_count()


def node_host_bytes(rank_host_bytes: int, ranks_per_node: int) -> int:
    """Host memory one node's ranks hold, what a host budget bounds: the largest rank's host bytes (offloaded
    activations, optimizer state) times the ranks on the node. Measured runs and the simulator both charge this."""
    return rank_host_bytes * ranks_per_node


def host_over_budget_error(node_bytes: int, budget_bytes: int, budget_name: str) -> str:
    """The one-line error of a run whose node offloads more than its host budget."""
    host, budget = format_sizes_apart(node_bytes, budget_bytes)
    return f"host memory: the node's ranks offload {host}, over {budget_name} {budget}"


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a wall-clock interval covers the work done in it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """(fn(), seconds), device-synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def summarize_times(samples: list[float]) -> dict[str, Any]:
    """The record's iter_time_s: median, min, max and every sample (seconds)."""
    if not samples:
        return {"median": None, "min": None, "max": None, "samples": []}
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "samples": list(samples)}


@dataclass
class MemoryReport:
    """One rank's peak memory. `peak_bytes` is what records compare; `detail` says how it was obtained."""

    peak_bytes: int
    detail: dict[str, Any] = field(default_factory=dict)


class MemoryMeter(ABC):
    """Measures one rank's peak memory. Use: `with meter.session(): <build, warm up>; with meter.measured_step():
    <one step>`, then the timed steps, then `meter.report()`."""

    def session(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def measured_step(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @abstractmethod
    def report(self) -> MemoryReport:
        """The peak of the measured step (CPU) or of the measured and timed steps (GPU)."""


class CudaMemoryMeter(MemoryMeter):
    """The caching allocator's own peaks, from the measured step through the timed steps."""

    def __init__(self, device: torch.device):
        self.device = device
        self.at_start: int | None = None

    @contextlib.contextmanager
    def measured_step(self) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        torch.cuda.reset_peak_host_memory_stats()  # pinned host buffers (offloaded activations), booked apart
        self.at_start = torch.cuda.memory_allocated(self.device)  # model state + batch: what no length changes
        yield

    def report(self) -> MemoryReport:
        torch.cuda.synchronize(self.device)
        allocated = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        return MemoryReport(allocated, {"memory_kind": "cuda-max-allocated", "peak_reserved_bytes": reserved,
                                        "resident_at_step_start_bytes": self.at_start,
                                        "host_offloaded_bytes": torch.cuda.host_memory_stats().get(
                                            "active_bytes.peak", 0),
                                        "device_total_bytes":
                                            torch.cuda.get_device_properties(self.device).total_memory})


class CpuAllocationMeter(MemoryMeter):
    """Peak live tensor bytes from the profiler's CPU allocation events (see the module docstring)."""

    MARK = "autosp::measured_step"

    def __init__(self) -> None:
        self._profiler: torch.profiler.profile | None = None
        self._report: MemoryReport | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                profile_memory=True)
        with settled_collectives(), self._profiler:
            yield
        self._report = allocation_peak(self._profiler, self.MARK)

    def measured_step(self) -> contextlib.AbstractContextManager:
        if self._profiler is None:
            raise RuntimeError("CpuAllocationMeter.measured_step() must run inside session()")
        return torch.profiler.record_function(self.MARK)

    def report(self) -> MemoryReport:
        if self._report is None:
            raise RuntimeError("no measured step: run one inside session() first")
        return self._report


#: how long a completed collective's wait() lingers while memory is measured (see the module docstring)
SETTLE_S = 0.002


@contextlib.contextmanager
def settled_collectives() -> Iterator[None]:
    """Make collectives' tensors be freed by the calling thread: wait() returns only after the worker let go."""
    work_type = torch.distributed.Work
    original = work_type.wait

    def wait_and_settle(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        time.sleep(SETTLE_S)
        return result

    work_type.wait = wait_and_settle
    try:
        yield
    finally:
        work_type.wait = original


def _inside(node: Any, name: str) -> bool:
    parent = node.parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.parent
    return False


def _op_of(node: Any) -> str:
    """The innermost aten op (else the innermost named event) whose call made allocation `node`."""
    parent, named = node.parent, ""
    while parent is not None:
        if parent.name.startswith("aten::"):
            return parent.name
        named = named or parent.name
        parent = parent.parent
    return named


def allocation_peak(profiler: torch.profiler.profile, mark: str) -> MemoryReport:
    """Replay the profiled CPU allocation stream; peak of live bytes inside the `mark` region.

    Host memory apart: on CPU the emulated device and the host are the same memory, so what the offload op
    allocates (`autosp.compiler.memory.offload`: the host copies of offloaded activations), and its later free at the
    same address, are booked to a separate host pool, not to the device peak; the record gets the host pool's
    peak in the step as `host_offloaded_bytes`. So is what the optimizer offload allocates inside its host region
    (`autosp.comm.host_optimizer.HOST_REGION`: master weights, gradient buffers, AdamW moments and the step's
    temporaries; with offload=params also the parameters), from wherever in the run it was made (setup, the warm-up's
    first step), and what the parameter offload's gradient copies allocate (`autosp.comm.host_params`).
    A free whose allocation this profile did not see (a tensor of an earlier profiled run in the same process,
    collected mid-run: torch remembers its size) is skipped, so a run's count never depends on what ran before it.
    `peak_op` names the aten op (or, inside an Inductor graph, the graph's call) whose allocation set the peak."""
    from autosp.comm.host_optimizer import HOST_REGION
    from autosp.comm.host_params import GRADIENT_TO_HOST_NAME
    from autosp.compiler.memory import OFFLOAD_OP_NAME

    allocations: list[tuple[int, int, int, bool, str]] = []  # (time ns, +size / -size, address, host, by op)
    windows: list[tuple[int, int]] = []
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == torch._C._profiler._EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                host = fields.alloc_size > 0 and any(_inside(node, name) for name in (OFFLOAD_OP_NAME, HOST_REGION,
                                                                                      GRADIENT_TO_HOST_NAME))
                allocations.append((node.start_time_ns, fields.alloc_size, fields.ptr, host, _op_of(node)))
        elif node.name == mark:
            windows.append((node.start_time_ns, node.end_time_ns))
        stack.extend(node.children)
    if len(windows) != 1:
        raise RuntimeError(f"expected exactly one measured step in the profile, found {len(windows)}")
    begin, end = windows[0]
    allocations.sort(key=lambda a: a[0])  # stable: same-time events keep their recorded order
    live = host_live = 0
    overall_peak = host_peak = 0
    host_addresses: set[int] = set()
    device_addresses: set[int] = set()  # a free counts only where this profile saw the allocation (see below)
    at_start: int | None = None
    step_peak = 0
    peak_op = ""
    for when, size, address, host, op in allocations:
        if when > end:
            break
        if when >= begin and at_start is None:
            at_start = live
            step_peak = live
            host_peak = host_live
        if host or (size < 0 and address in host_addresses):
            (host_addresses.add if size > 0 else host_addresses.discard)(address)
            host_live += size
            if at_start is not None:
                host_peak = max(host_peak, host_live)
            continue
        if size < 0 and address not in device_addresses:
            continue  # garbage from an earlier profiled run: torch reports its size, this replay never counted it
        (device_addresses.add if size > 0 else device_addresses.discard)(address)
        live += size
        overall_peak = max(overall_peak, live)
        if at_start is not None and live > step_peak:
            step_peak, peak_op = live, op
    if at_start is None:  # a step that allocated nothing
        at_start = step_peak = live
    return MemoryReport(step_peak, {
        "memory_kind": "cpu-profiler-allocations",
        "resident_at_step_start_bytes": at_start,
        "step_increase_bytes": step_peak - at_start,
        "peak_including_setup_bytes": overall_peak,
        "allocation_events": len(allocations),
        "host_offloaded_bytes": host_peak,
        "peak_op": peak_op,
    })


def memory_meter(device: torch.device) -> MemoryMeter:
    return CudaMemoryMeter(device) if device.type == "cuda" else CpuAllocationMeter()


def apply_device_budget(device: torch.device, budget_bytes: int | None) -> None:
    """On a GPU, cap this process's allocator at the budget so exceeding it raises a real OutOfMemoryError.

    On CPU nothing is capped: the runner compares the measured peak with the budget afterwards.
    """
    if budget_bytes is None or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if budget_bytes < total:
        torch.cuda.set_per_process_memory_fraction(budget_bytes / total, device)

