"""`LiveStorageTracker`: every storage an executed aten op makes, counted once from its creation until Python frees
it, charged at the device's allocator blocks; each phase's peak and what is live at it (`PhasePeak`, `RankPeak`)."""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from autosp.comm.host_params import GRADIENT_TO_HOST_OP
from autosp.comm.transients import declared_transient_bytes
from autosp.compiler.memory import OFFLOAD_OP
from autosp.experiments.simulate.clock import LinedTrace, OpTrace, StepClock
from autosp.experiments.simulate.config import AFTER_BACKWARD, COMPONENTS
from autosp.experiments.simulate.devices import DeviceModel


class LiveStorageTracker(TorchDispatchMode):
    """Live tensor storage bytes over the executed op sequence, raw and in device allocator blocks.

    A storage is counted from the first op that outputs it until it is freed (a weakref finalizer). A wrapper
    subclass (FSDP2's DTensor) is seen before its own dispatch runs the local op (unseen, the mode is off
    there), and holds no memory itself: its inner tensors are counted instead. Each storage's
    size is re-read at every op, so storages resized in place (FSDP2 frees gathered parameters that way)
    are followed. Since `reset_peak()` each phase of the step (forward, backward, after backward, optimizer) keeps
    its own peak of the device-charged total (`moments`), with the storages live at that moment (for the breakdown)
    and the op that reached it: the layer extrapolation follows each phase's peak on its own (`extrapolate_peak`);
    `peak()` is the highest. While an op runs, the scratch it declares (`autosp.comm.transients`: the planner's
    registry) is charged on top, as one allocation: on fake tensors an opaque op runs its fake kernel, which
    allocates only its outputs (a recurrence's chunk intermediates, an all-to-all's buffers, a loss tile's logits).

    Host memory apart: the outputs of `autosp_sp::offload` (offloaded activations, `autosp.compiler.memory`) and
    of `autosp_sp::gradient_to_host` (gradients streamed to host memory, `autosp.comm.host_params`) and
    the storages a program makes inside `host_allocations()` (an adapter's call sites that allocate on the host,
    e.g. DeepSpeed's optimizer offload) live in host memory, so they are kept out of the device total; `host_peak`
    is their most bytes alive at once.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # off while Dynamo/aot_autograd trace, on while the compiled graphs run

    def __init__(self, device: DeviceModel) -> None:
        super().__init__()
        self.device = device
        self.live: dict[int, weakref.ref] = {}  # serial number -> storage (serials: ids of dead objects recur)
        self.serials: dict[int, int] = {}  # id of a live storage object -> its serial number
        self.serial = 0
        self.moments: dict[str, PeakMoment] = {}  # each phase's peak in the measured step, in step order
        self.phase = "setup"
        self.ops = 0
        self.watching = False  # peaks are followed only in the measured step (the warm-up's peak is never read)
        self.blocks = _BlockCache(device.block_bytes)  # storage bytes -> bytes charged (every op re-sums them)
        self.host: set[int] = set()  # serials of host storages (offloaded activations)
        self.host_peak = 0
        self.healthy = False  # inside `assume_healthy_step`
        self.assumed_reads = 0
        self.known_answer: bool | None = None  # inside `known_boolean_reads`
        self.on_host = False  # inside `host_allocations`
        self.clock: StepClock | None = None  # prices each op of the measured step (`programs.RankProgram.measure`)

    def track(self, tensor: torch.Tensor) -> int:
        """The serial number of `tensor`'s storage, counted from now on if it was not yet."""
        storage = tensor.untyped_storage()
        address = id(storage)
        if address not in self.serials:
            self.serial += 1
            self.serials[address] = self.serial
            self.live[self.serial] = weakref.ref(storage)
            weakref.finalize(storage, self._forget, address, self.serial)
            if self.on_host:
                self.host.add(self.serial)
        return self.serials[address]

    @contextlib.contextmanager
    def host_allocations(self) -> Iterator[None]:
        """Every storage first counted in here lives in host memory (storages made earlier keep their place: an op
        in here writing into a device tensor leaves it on the device)."""
        outer, self.on_host = self.on_host, True
        try:
            yield
        finally:
            self.on_host = outer

    def mark_host(self, tensor: torch.Tensor) -> None:
        """`tensor`'s storage lives in host memory (a buffer an adapter knows the program allocates on the host)."""
        self.host.add(self.track(tensor))

    def _forget(self, address: int, serial: int) -> None:
        self.live.pop(serial, None)
        self.host.discard(serial)
        if self.serials.get(address) == serial:
            del self.serials[address]

    def untrack(self, serial: int) -> None:
        """Stop counting a storage that is still alive but no longer the program's (see `RankProgram.measure`)."""
        self.live.pop(serial, None)
        self.host.discard(serial)

    def sizes(self) -> dict[int, int]:
        """Bytes of every live device storage, by serial number."""
        return {serial: storage.nbytes() for serial, ref in self.live.items()
                if serial not in self.host and (storage := ref()) is not None}

    def host_bytes(self) -> int:
        return sum(storage.nbytes() for serial in self.host if (storage := self.live[serial]()) is not None)

    def charged(self, sizes: dict[int, int]) -> int:
        return sum(map(self.blocks.__getitem__, sizes.values()))

    def reset_peak(self) -> None:
        self.watching = True
        self.host_peak = 0
        sizes = self.sizes()
        self.moments = {self.phase: PeakMoment(self.charged(sizes), sizes, "(step start)", self.ops)}

    def peak(self) -> PeakMoment:
        """The step's peak: the highest phase peak (on a tie the earlier moment, as a running maximum keeps it)."""
        return max(self.moments.values(), key=lambda moment: (moment.charged, -moment.at))

    @contextlib.contextmanager
    def assume_healthy_step(self) -> Iterator[None]:
        """Boolean reads of fake data (`bool(t)`) answer False here: "is any gradient non-finite / negative?".

        A fake tensor has no values, so a data-dependent branch cannot be taken from data. Optimizer steps ask
        one kind of question — DeepSpeed's ZeRO-3 step `is_invalid_grad_norm(norm)`, `bool((~isfinite(norm) |
        (norm < 0)).any())` — and a healthy step (the one whose memory is predicted: the update is applied, not
        skipped) answers False. DeepSpeed's optimizer-offload step also reads the gradient norm as a number
        (`complete_grad_norm_calculation_for_cpu_offload`: `float(total_norm)`); a healthy step's norm is finite, and
        which finite number does not change what is allocated (no gradient clipping in these configs), so a numeric
        read of a fake tensor without a value answers 1.0 (a real tensor, or a fake one that keeps its constant such as
        AdamW's step count, is read as it is). Only in optimizer steps; any other read still fails the simulation (e.g.
        `.item()` of a length), and the count of assumed answers goes to the record."""
        self.healthy = True
        try:
            yield
        finally:
            self.healthy = False

    @contextlib.contextmanager
    def known_boolean_reads(self, answer: bool) -> Iterator[None]:
        """Boolean reads of fake data answer `answer` here: for a method's adapter that knows the real run's answer
        from what the simulator constructed (each use says why in its docstring)."""
        self.known_answer = answer
        try:
            yield
        finally:
            self.known_answer = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - the dispatch protocol
        if self.known_answer is not None and func is torch.ops.aten._local_scalar_dense.default \
                and args[0].dtype == torch.bool:
            return self.known_answer
        if self.healthy and func is torch.ops.aten._local_scalar_dense.default and (
                args[0].dtype == torch.bool or getattr(args[0], "constant", 0) is None):  # a number with no value
            self.assumed_reads += 1
            return False if args[0].dtype == torch.bool else 1.0
        return self.record(func, func(*args, **(kwargs or {})), args, kwargs or {})

    def record(self, func: Any, out: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Count `out`, what `func` just made of `args`, follow the phase's peak and the step's clock; returns
        `out`."""
        self.ops += 1
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                for inner in _inner_tensors(value):
                    serial = self.track(inner)
                    if func is OFFLOAD_OP or func is GRADIENT_TO_HOST_OP:
                        self.host.add(serial)
        if not self.watching:
            return out
        if self.clock is not None:
            self.clock.op(func, args, kwargs or {}, out, self.track, self.host)
        self.host_peak = max(self.host_peak, self.host_bytes()) if self.host else self.host_peak
        sizes = self.sizes()
        charged = self.charged(sizes)
        if scratch := declared_transient_bytes(func, args, kwargs or {}):  # what its fake kernel did not allocate
            charged += self.blocks[scratch]
        phase = "backward" if torch._C._current_graph_task_id() != -1 else self.phase
        if phase == "forward" and "backward" in self.moments:
            phase = AFTER_BACKWARD  # e.g. a gradient all-reduce of flattened gradients, between backward and step
        moment = self.moments.get(phase)
        if moment is None or charged > moment.charged:
            self.moments[phase] = PeakMoment(charged, sizes, str(func), self.ops)
        return out


def _wrapped_op_rule(hop: Any) -> None:
    """The tracker's rule for a higher-order op wrapping one op (the RNG-state wrappers the partitioner puts around
    random ops recomputed in backward, as under `--sac full`): run it below the tracker, count its outputs."""
    hop.py_impl(LiveStorageTracker)(lambda mode, *args, **kwargs: mode.record(hop, hop(*args, **kwargs), args,
                                                                              kwargs))


for _hop in (run_and_save_rng_state, run_with_rng_state):
    _wrapped_op_rule(_hop)


@dataclass
class PeakMoment:
    """The most device bytes one phase of the measured step held: the charged total, the storages live then
    (serial -> bytes, for the breakdown), the op that reached it and when (the tracker's op count)."""

    charged: int
    sizes: dict[int, int]
    op: str
    at: int


class _BlockCache(dict):
    """`device.block_bytes` memoised by size: a dict lookup per live storage and op instead of a call."""

    def __init__(self, block_bytes: Any) -> None:
        super().__init__()
        self.block_bytes = block_bytes

    def __missing__(self, nbytes: int) -> int:
        self[nbytes] = charged = self.block_bytes(nbytes)
        return charged


@dataclass
class PhasePeak:
    """One phase's peak (bytes charged in device blocks, context and workspaces not included) and its breakdown."""

    peak_bytes: int
    live_tensor_bytes: int  # the same moment, unrounded: what the CPU meter counts
    model_state_bytes: int  # parameters, buffers, optimizer states (resident when the step starts), batch
    gradient_bytes: int  # parameter gradients live at the peak
    saved_activation_bytes: int  # tensors saved for backward and still live at the peak
    transient_bytes: int  # everything else live at the peak: the working set of the op there
    peak_op: str


#: the terms of a peak that grow by the same bytes per layer (`extrapolate_peak`)
LINEAR_TERMS = ("peak_bytes", "live_tensor_bytes", *COMPONENTS)


@dataclass
class RankPeak(PhasePeak):
    """One rank's predicted peak: the highest phase peak (its terms above), and every phase's own."""

    peak_phase: str
    num_layers: int
    ops: int
    host_offloaded_bytes: int = 0  # offloaded activations in host memory, most alive at once (not in peak_bytes)
    assumed_healthy_reads: int = 0  # boolean reads of fake data answered "no" (`assume_healthy_step`)
    phases: dict[str, PhasePeak] = field(default_factory=dict)  # forward / backward / optimizer: each one's peak
    plans: list[dict] = field(default_factory=list)  # the memory planner's choice per graph compiled for this length
    recompute_flops: int | None = None  # FLOPs of forward ops re-run in backward, where counted (`TrainStep`)
    trace: OpTrace | LinedTrace | None = None  # the measured step's ops for the time model (`clock`)


def _inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that hold `t`'s memory: itself, or a wrapper subclass's inner tensors (recursively)."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _inner_tensors(inner)
    else:
        yield t


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameters/gradients), else the tensor."""
    return getattr(t, "_local_tensor", t)
