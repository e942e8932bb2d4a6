"""`autosp simulate`: one rank's peak memory of a P-rank job on a GPU you do not have, predicted on this CPU.

Mechanism: rank r's *real* program runs on fake tensors. A fake process group (`backend="fake"`, PyTorch's
`FakeStore`) makes this process rank r of P without peers (collectives hallucinate their outputs), and
`FakeTensorMode` makes every tensor shape-only (meta storage, no data, no memory). The harness then does what
`autosp run` does on a rank — build the model from the preset, hand it to the method's `Strategy.setup` (the
same strategy code, the same SP pass and SAC partitioner for the compiled methods), a warm-up step and one
measured step (forward, backward, AdamW) — while `LiveStorageTracker`, a TorchDispatchMode that sees every
executed aten op (compiled graphs included: it ignores compile internals, so it sees what the compiled
artifact runs, not the tracing), counts each output storage once from its creation until Python frees it.
That is the quantity `autosp run`'s CPU meter measures with the profiler; each storage is also charged at its
allocator block size (`autosp.experiments.devices`) and the device's context/workspace are added.

PyTorch's own tools were the starting point: `torch.distributed._tools.MemTracker` counts the same thing per
module, but it is a dispatch mode without `ignore_compile_internals`, so under it Dynamo refuses to compile
(it skips frames under non-infra dispatch modes) and a compiled method would be measured uncompiled;
inductor's `estimate_peak_memory` needs inductor's scheduler, i.e. real inductor compiles.

Compiled methods (autosp, ulysses-compile) are simulated with the aot_eager backend: the graphs that run are
the ones the method really builds (Dynamo graph -> SP pass -> aot_autograd with the SAC partition function),
so the saved-for-backward set is exact; inductor's fusion is NOT modelled — every intermediate of those
graphs is materialised, stated in the record (`extra.fusion`). That is not a bound either way: unfused
intermediates over-count inductor's working set, while a fused kernel can hold its inputs and outputs at once
(tiled autosp on `tiny`/`small`: inductor's run measured 0.8-5.7% above the simulation, README). Inductor's
kernels themselves cannot run on fake tensors (its C++/Triton kernels take data pointers). DeepSpeed's AutoSP calls `torch._inductor.compile` itself: there the graph goes
through `aot_eager_decomp_partition` (inductor's decompositions and min-cut partitioner, into which DeepSpeed
splices its long-context checkpointing), equally unfused.

DeepSpeed's engines (zero3, ds-autosp) run as they are, with three adapters, each exact or stated:
`Module.to(<the device it is on>)` is the identity (torch's `_apply` cannot swap fake parameters);
DeepSpeed's cross-rank consistency checks (a broadcast of rank 0's host ints, read back with `.item()`) get rank
0's own list, which is what the broadcast delivers to the simulated rank 0; boolean reads in an optimizer step
("is the gradient norm invalid?") answer no (`LiveStorageTracker.assume_healthy_step`, counted in the record).
FSDP2 (`fsdp`, `ulysses/ring --zero 3`) runs unchanged; its world mesh is built with the context, outside
FakeTensorMode (a DeviceMesh reads its rank table, which would be a fake tensor there).

Speed: a model deeper than `EXACT_LAYERS` is simulated at 2 and 3 layers and extrapolated linearly to the real
depth, phase by phase (`_extrapolate`). Layers are identical, so at an op at a fixed place relative to the layers
(the last layer's backward, the step after the last gradient) every term - model state, gradients, saved
activations, the transient working set - grows by the same bytes per layer. The tracker keeps each phase's own
peak (forward, backward, after backward: e.g. a gradient all-reduce; optimizer) with the storages live at it, so
each phase's peak and breakdown are extrapolated along their own line, and the phase highest at the real depth is
the answer: with depth the AdamW step (state, gradients and its multi-tensor temporary) or the flattened gradients
after backward can overtake a backward peak that short models reach in the logits' gradient (an H200 run of
llama-3.2-1b peaked in the AdamW step). The line is one op's only if the winning phase peaks at the same op in
both runs. Where it does not, 4 layers are simulated too and the line through 3 and 4 is used if their ops agree:
a 2-layer model is all boundary - its first layer is also the last but one, so an op of an inner layer (one with
a layer on either side, e.g. where a prefetch of the next layer's parameters meets the previous one's gradients)
does not exist there (seen: FSDP2's backward on llama-2-13b and on a wide `tiny-mha`, at a view at 2 layers, at a
multiplication from 3 on). From 3 layers on the inner layers are copies of one another, so an op at a fixed place
has terms linear in the depth - provided a layer's ops depend only on its neighbours (boundary effects one layer
deep), which is why 3 and 4 must agree before their line is used. Only if they disagree too is the whole depth
simulated (`extra.note` says why). The FSDP2-sharded baselines start from 3 and 4 layers: a layer's program there
reaches into its neighbours' (prefetch, reduce-scatter), and 2 layers were off the line even at an op of the same
name (`_layers_reach_their_neighbours`). DeepSpeed's ZeRO-3 is always simulated whole (`NOT_LINEAR_IN_DEPTH`).
tests/experiments/test_simulate.py checks both paths against full-depth simulations. What the extrapolation cannot
see: an op whose line is below the winner's at 2-3 (or 3-4) layers but steeper, overtaking only deeper (a losing
phase whose peak op differs between the two depths is one: a phase's peak is the highest of its ops' lines, so the
line through two of its ops can only underestimate it deeper); and the allocator's rounding of a storage whose size
grows with the depth (a flat buffer of all gradients or parameters): its raw bytes are linear, its whole blocks are
not, and the step in blocks between the two depths is carried to the real depth, off by up to one block per further
layer and such storage (GPU devices; the CPU device does not round. Seen: ds-autosp hf:llama-3.2-1b at 223232 tokens
on mi250-gcd, live bytes exact, model state 42 MiB (0.07%) above the 16-layer simulation; ring's flattened gradients
on a 6-layer test model on an H200, one 2 MiB block below, which let the optimizer phase win there).
A search keeps each depth's rank program across its probes (`shared_rank_programs`, for the methods in
`SHARED_PROGRAM_METHODS`): a later length runs only its measured step on the same model and AdamW states, and a
compiled method's sequence dimension is traced symbolically once by Dynamo, then specialised per length for the SP
pass and the partitioner (`autosp.compiler.specialize`), so a probe skips building, setup, the warm-up step and
Dynamo's trace; the peaks are those of a fresh program per length (a test checks every field).

What it cannot run it says, in one line (status `error`): the method's own error (e.g. DeepSpeed's AutoSP
compile fails on the project Llama, as it does when measured) or the fake-tensor failure, never a number.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from autosp.compiler.offload import OFFLOAD_OP
from autosp.errors import AutoSPError
from autosp.experiments.devices import DeviceModel, get_device_model
from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.measure import format_size

if TYPE_CHECKING:
    import pandas as pd

#: models up to this depth are simulated whole; deeper ones at 2 and 3 layers, extrapolated
EXACT_LAYERS = 4
#: methods whose engines cannot run on fake tensors, with the reason (checked before anything is built)
UNSUPPORTED: dict[str, str] = {}
#: compiled methods run their real graphs through this backend on fake tensors
SIMULATED_BACKEND = "aot_eager"
#: what a method's own `torch._inductor.compile` call (DeepSpeed's AutoSP) runs on fake tensors
DIRECT_INDUCTOR_BACKEND = "aot_eager_decomp_partition"
#: the phase of the ops between the backward pass and the optimizer step (outside autograd's engine)
AFTER_BACKWARD = "after backward"
COMPONENTS = ("model_state_bytes", "gradient_bytes", "saved_activation_bytes", "transient_bytes")


class SimulationError(ConfigError):
    """A configuration the simulator cannot run (one line: what and why)."""


class LiveStorageTracker(TorchDispatchMode):
    """Live tensor storage bytes over the executed op sequence, raw and in device allocator blocks.

    A storage is counted from the first op that outputs it until it is freed (a weakref finalizer). A wrapper
    subclass (FSDP2's DTensor) is seen before its own dispatch runs the local op (unseen, the mode is off
    there), and holds no memory itself: its inner tensors are counted instead. Each storage's
    size is re-read at every op, so storages resized in place (FSDP2 frees gathered parameters that way)
    are followed. Since `reset_peak()` each phase of the step (forward, backward, after backward, optimizer) keeps
    its own peak of the device-charged total (`moments`), with the storages live at that moment (for the breakdown)
    and the op that reached it: the layer extrapolation follows each phase's peak on its own (`_extrapolate`);
    `peak()` is the highest.

    Host memory apart: the outputs of `autosp_sp::offload` (offloaded activations, `autosp.compiler.offload`)
    live in host memory, so they are kept out of the device total; `host_peak` is their most bytes alive at once.
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

    def track(self, tensor: torch.Tensor) -> int:
        """The serial number of `tensor`'s storage, counted from now on if it was not yet."""
        storage = tensor.untyped_storage()
        address = id(storage)
        if address not in self.serials:
            self.serial += 1
            self.serials[address] = self.serial
            self.live[self.serial] = weakref.ref(storage)
            weakref.finalize(storage, self._forget, address, self.serial)
        return self.serials[address]

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
        skipped) answers False. Only boolean reads, only in optimizer steps; any other read still fails the
        simulation (e.g. `.item()` of a length), and the count of assumed answers goes to the record."""
        self.healthy = True
        try:
            yield
        finally:
            self.healthy = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - the dispatch protocol
        if self.healthy and func is torch.ops.aten._local_scalar_dense.default and args[0].dtype == torch.bool:
            self.assumed_reads += 1
            return False
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                for inner in _inner_tensors(value):
                    serial = self.track(inner)
                    if func is OFFLOAD_OP:
                        self.host.add(serial)
        if not self.watching:
            return out
        self.host_peak = max(self.host_peak, self.host_bytes()) if self.host else self.host_peak
        sizes = self.sizes()
        charged = self.charged(sizes)
        phase = "backward" if torch._C._current_graph_task_id() != -1 else self.phase
        if phase == "forward" and "backward" in self.moments:
            phase = AFTER_BACKWARD  # e.g. a gradient all-reduce of flattened gradients, between backward and step
        moment = self.moments.get(phase)
        if moment is None or charged > moment.charged:
            self.moments[phase] = PeakMoment(charged, sizes, str(func), self.ops)
        return out


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


#: the terms of a peak that grow by the same bytes per layer (`_extrapolate`)
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


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as rank `rank` of a `world_size` job whose collectives only hallucinate outputs.

    What a job's program changes process-wide ends with the world: DeepSpeed's ZeRO-3 replaces
    `torch.nn.functional.linear` by its own autograd function ("this will persist unless manually reset") — part of
    the zero3 program, but the next program in this process (a later cell of a `simulate-table` worker, another
    test) would trace it too (autosp's compile then fails on it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulate needs a process without a process group")
    os.environ.setdefault("LOCAL_RANK", "0")
    linear = torch.nn.functional.linear
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_deepspeed_groups()
        torch.nn.functional.linear = linear


def _forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the process groups it derives in module globals; they die with this fake world, so the
    next simulation in this process (e.g. the 3-layer one after the 2-layer one) must not find them."""
    import importlib
    import sys

    if (groups := sys.modules.get("deepspeed.utils.groups")) is not None:
        importlib.reload(groups)  # its globals back to their import-time values (None, {})
    if (registry := sys.modules.get("deepspeed.compile.custom_ops.sp_dp_registry")) is not None:
        registry.GROUP_REGISTRY.clear()
    _keep_deepspeed_splice()


def _keep_deepspeed_splice() -> None:
    """DeepSpeed's AutoSP splices its long-context checkpointing into torch's min-cut partitioner from the
    partitioner's source (process-wide, once: a second splice finds no source, `OSError: could not get source
    code`); the splice made by the first engine stays, and a later engine (another depth of the same cell, or
    the next simulation) registers nothing."""
    import sys

    if (init_sp := sys.modules.get("deepspeed.compile.init_sp")) is not None:
        init_sp.register_long_context_checkpointing = lambda: None


def _fake_batch(real: Any, count: int, fake_mode: Any, tracker: LiveStorageTracker) -> Any:
    """The global batch as fake tensors; its valid-label count (data, not shape) read from the real one."""
    from autosp.models.data import Batch

    class CountedBatch(Batch):
        def num_valid_labels(self) -> int:
            return count

    fields = {k: None if v is None else fake_mode.from_tensor(v) for k, v in real.model_kwargs().items()}
    batch = CountedBatch(**fields)
    for t in fields.values():
        if t is not None:
            tracker.track(t)
    return batch


def simulate_rank(cfg: RunConfig, device: DeviceModel, *, num_layers: int | None = None, rank: int = 0) -> RankPeak:
    """Run rank `rank` of `cfg` on fake tensors; its peak over one measured step (after cfg.warmup >= 1 steps)."""
    torch._dynamo.reset()  # every simulation compiles its own graphs (and stays under the recompile limit)
    with fake_world(cfg.world_size, rank):
        return RankProgram(cfg, device, num_layers=num_layers, rank=rank).measure(cfg)


class RankProgram:
    """Rank r's program at one depth: model, method and AdamW state built once, then stepped at any length.

    `measure(cfg)` runs cfg.warmup >= 1 steps the first time (they create the optimizer states and compile), then
    the measured step at cfg's length. Kept across lengths (`shared_rank_programs`), a later length runs only its
    measured step on the same model and optimizer states: what a fresh program holds at the start of its measured
    step (the previous length's activations are freed; compiling is outside the tracker, as it is in a fresh
    program's warm-up). A compiled method's sequence dimension is traced symbolically there, so Dynamo traces
    the model once and the backend specialises each length (`autosp.compiler.specialize`): the SP pass and the
    partitioner still see the static graph of each length. Needs the process group of `fake_world` to be up."""

    def __init__(self, cfg: RunConfig, device: DeviceModel, *, num_layers: int | None = None, rank: int = 0,
                 shared: bool = False) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        from autosp.harness.parallel import build_context
        from autosp.harness.runner import DTYPES, validate
        from autosp.models import build_model, get_preset

        self.strategy, self.sp_size = validate(cfg)
        self.rank, self.shared = rank, shared
        self.layers = num_layers or get_preset(cfg.model).num_layers
        self.tracker = tracker = LiveStorageTracker(device)
        self.ctx = build_context(self.sp_size, torch.device("cpu"))
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.warmed = False
        self.earlier_inputs: list[int] = []  # serials of the batch of the previous measured length
        with self.fake_mode, tracker, _deepspeed_autosp_per_length(shared and cfg.method == "ds-autosp"):
            torch.manual_seed(cfg.seed)
            self.model = build_model(cfg.model, seed=cfg.seed, dtype=DTYPES[cfg.dtype], num_layers=self.layers)
            self.model.to = _identity_move(self.model)
            self.step = self.strategy.setup(self.model, self.ctx, cfg)
        _keep_deepspeed_splice()  # the next engine of this cell (another depth) shares this one's splice

    def measure(self, cfg: RunConfig) -> RankPeak:
        """The peak of one measured step (forward, backward, AdamW) at cfg.seq_len."""
        from autosp.harness.runner import global_batch

        real_batch = global_batch(cfg, self.sp_size)
        valid_labels = real_batch.num_valid_labels()  # data, not shape: read before tensors turn fake
        tracker, step, model = self.tracker, self.step, self.model
        ops, assumed_reads = tracker.ops, tracker.assumed_reads  # this call's counts, warm-up included
        with self.fake_mode as fake_mode, tracker, contextlib.ExitStack() as stack:
            if self.shared:  # one symbolic trace serves every length; past the recompile limit fail, never run eager
                stack.enter_context(torch.compiler.config.patch(dynamic_sources=DYNAMIC_SEQUENCE_SOURCES))
                stack.enter_context(torch._dynamo.config.patch(fail_on_recompile_limit_hit=True))
            stack.enter_context(_deepspeed_rank0_answers(self.rank))
            stack.enter_context(_inductor_compile_unfused())
            stack.enter_context(_optimizer_implementation_of(tracker.device))
            batch = _fake_batch(real_batch, valid_labels, fake_mode, tracker)
            # an earlier length's batch can outlive its step (an earlier specialisation's compile still refers to
            # it); a fresh program at this length never had it, so it is not counted
            for serial in self.earlier_inputs:
                tracker.untrack(serial)
            self.earlier_inputs = [tracker.track(t) for t in batch.model_kwargs().values()]
            for _ in range(0 if self.warmed else max(cfg.warmup, 1)):
                step.forward_backward(batch)
                with tracker.assume_healthy_step():
                    step.optimizer_step()
            self.warmed = True
            resident = set(tracker.sizes())
            gradients: set[int] = set()
            saved: set[int] = set()
            hooks = [p.register_post_accumulate_grad_hook(
                lambda p: gradients.add(tracker.track(_local(p.grad))))
                for p in model.parameters() if p.requires_grad]

            def pack(t: torch.Tensor) -> torch.Tensor:
                # the step's own tensors only: a shared program compiles a new length inside its measured step,
                # and aot_autograd's tracing there saves tensors of its own fake mode
                if getattr(_local(t), "fake_mode", None) is fake_mode:
                    saved.add(tracker.track(_local(t)))
                return t

            tracker.phase = "forward"
            tracker.reset_peak()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                step.forward_backward(batch)
            tracker.phase = "optimizer"
            with tracker.assume_healthy_step():
                step.optimizer_step()
            for hook in hooks:
                hook.remove()
            tracker.watching = False
        charge = tracker.device.block_bytes

        def breakdown(moment: PeakMoment) -> PhasePeak:
            def part(keys: set[int]) -> int:
                return sum(charge(n) for k, n in moment.sizes.items() if k in keys)

            state = part(resident)
            grads = part(gradients - resident)
            acts = part(saved - resident - gradients)
            return PhasePeak(peak_bytes=moment.charged, live_tensor_bytes=sum(moment.sizes.values()),
                             model_state_bytes=state, gradient_bytes=grads, saved_activation_bytes=acts,
                             transient_bytes=moment.charged - state - grads - acts, peak_op=moment.op)

        phases = {phase: breakdown(moment) for phase, moment in tracker.moments.items()}
        peak = tracker.peak()
        peak_phase = next(phase for phase, moment in tracker.moments.items() if moment is peak)
        return RankPeak(**vars(phases[peak_phase]), peak_phase=peak_phase, num_layers=self.layers,
                        ops=tracker.ops - ops, host_offloaded_bytes=tracker.host_peak,
                        assumed_healthy_reads=tracker.assumed_reads - assumed_reads, phases=phases)


#: methods whose rank program is kept across the lengths of a search (`shared_rank_programs`): their state at the
#: start of a measured step does not depend on the lengths stepped before (tests/experiments/test_simulate.py).
#: DeepSpeed's engines (zero3, ds-autosp) qualify too: what they keep across steps (ZeRO-3's partitions, its
#: gradient buckets and the prefetch trace of the module order, recorded in the warm-up step; ds-autosp's one
#: Dynamo trace of a sequence dimension it marks dynamic itself, compiled by DeepSpeed's backend per length:
#: `_deepspeed_autosp_per_length`) is sized by the parameters, not by the length.
SHARED_PROGRAM_METHODS = ("autosp", "ulysses", "ring", "fsdp", "zero3", "ds-autosp")
#: the batch's sequence dimension, traced symbolically by a shared compiled program (`torch.compiler.config`)
DYNAMIC_SEQUENCE_SOURCES = ",".join(f"L['{name}']:1" for name in ("input_ids", "labels", "position_ids",
                                                                  "attention_mask"))


class _SharedPrograms:
    """The rank programs of one configuration (any length), by depth and allocator blocks, in one fake world."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.programs: dict[tuple[int, int, int], RankProgram] = {}
        self.world = contextlib.ExitStack()

    def get(self, cfg: RunConfig, device: DeviceModel, layers: int) -> RankProgram:
        key = cfg.replace(seq_len=1).config_hash()
        if key != self.key:  # another configuration: its own world and compiled graphs
            self.close()
            torch._dynamo.reset()
            self.world.enter_context(fake_world(cfg.world_size))
            self.key = key
        slot = (layers, device.small_block_bytes, device.large_block_bytes)
        if slot not in self.programs:
            self.programs[slot] = RankProgram(cfg, device, num_layers=layers, shared=True)
        return self.programs[slot]

    def close(self) -> None:
        self.programs.clear()
        self.world.close()
        self.key = None


_SHARED: list[_SharedPrograms] = []  # the active scope of `shared_rank_programs`, if any


@contextlib.contextmanager
def shared_rank_programs() -> Iterator[None]:
    """Inside, a method of `SHARED_PROGRAM_METHODS` keeps its rank programs across lengths: a search's later
    probes skip building the model, the method's setup, the warm-up step and (compiled) Dynamo's trace.
    Re-entrant: an inner scope (one device's search) shares the outer one's programs (every device's)."""
    if _SHARED:
        yield
        return
    _SHARED.append(_SharedPrograms())
    try:
        yield
    finally:
        _SHARED.pop().close()


def _rank_peak(cfg: RunConfig, device: DeviceModel, layers: int | None = None) -> RankPeak:
    """`simulate_rank`, or a shared program's next measured step inside `shared_rank_programs`."""
    from autosp.models import get_preset

    if _SHARED:
        if cfg.method not in SHARED_PROGRAM_METHODS:
            _SHARED[0].close()  # a fresh program needs a process without a (fake) process group
        else:
            try:
                return _SHARED[0].get(cfg, device, layers or get_preset(cfg.model).num_layers).measure(cfg)
            except BaseException:
                _SHARED[0].close()  # a program stopped mid-step is not reused
                raise
    return simulate_rank(cfg, device, num_layers=layers)


@contextlib.contextmanager
def _optimizer_implementation_of(device: DeviceModel) -> Iterator[None]:
    """AdamW as the simulated device runs it. torch picks the implementation by the parameters' device: on a GPU
    the multi-tensor (foreach) step, which holds a temporary as large as all of a rank's parameters in fp32 (the
    square root of the second moments); on CPU, where the fake ranks run, a per-parameter loop with per-parameter
    temporaries. Measured on an H200 (llama-3.2-1b, P=2, 32K tokens, tiled, bf16 mixed): the step's peak sat in
    that temporary, 2.6 GiB above what the CPU implementation predicted."""
    if device.vendor == "cpu":
        yield
        return
    from unittest import mock

    def gpu_choice(params: list, differentiable: bool, use_fused: bool = False) -> tuple[bool, bool]:
        return False, not differentiable and not torch.jit.is_scripting()  # torch's default on CUDA/ROCm

    with mock.patch("torch.optim.adam._default_to_fused_or_foreach", gpu_choice):
        yield


@contextlib.contextmanager
def _inductor_compile_unfused() -> Iterator[None]:
    """A method's own direct call of `torch._inductor.compile(gm, inputs)` (DeepSpeed's AutoSP backend) runs the
    graph through `aot_eager_decomp_partition`: inductor's decompositions and min-cut partitioner (so DeepSpeed's
    long-context checkpointing, spliced into that partitioner, decides what is saved), every op unfused, as the
    compiled methods run through aot_eager. Inductor's kernels need real data."""
    from unittest import mock

    from torch._dynamo.backends.registry import lookup_backend

    def compile_unfused(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None) -> Any:
        return lookup_backend(DIRECT_INDUCTOR_BACKEND)(gm, example_inputs)

    with mock.patch("torch._inductor.compile", compile_unfused):
        yield


@contextlib.contextmanager
def _deepspeed_autosp_per_length(shared: bool) -> Iterator[None]:
    """A shared ds-autosp program compiles DeepSpeed's AutoSP backend per length on its one Dynamo trace
    (`autosp.experiments.deepspeed_per_length`): the engine set up here gets it from `init_autosp`."""
    if not shared:
        yield
        return
    from unittest import mock

    from deepspeed.compile import init_sp

    from autosp.experiments.deepspeed_per_length import per_length

    backend_of = init_sp.init_autosp
    with mock.patch.object(init_sp, "init_autosp", lambda config: per_length(backend_of(config))):
        yield


@contextlib.contextmanager
def _deepspeed_rank0_answers(rank: int) -> Iterator[None]:
    """DeepSpeed ZeRO-3's cross-rank consistency checks, answered exactly for the simulated rank 0.

    `assert_ints_same_as_other_ranks` broadcasts host ints (parameter ids, the module order) from rank 0 in a tensor
    and reads them back with `.item()`; under FakeTensorMode that tensor has no values. The simulated rank is rank
    0, whose own list is what the broadcast delivers, so the answer is that list (lengths alike). Only while a
    DeepSpeed engine was set up (its module is imported), else nothing is touched."""
    import sys
    from unittest import mock

    utils = sys.modules.get("deepspeed.runtime.zero.utils")
    if utils is None:
        yield
        return
    if rank != 0:
        raise SimulationError("DeepSpeed's engines are simulated as rank 0 only (their checks broadcast rank 0's lists)")
    with mock.patch.object(utils, "get_lst_from_rank0", list), \
            mock.patch.object(utils, "assert_lst_len_same_as_other_ranks", lambda lst: None):
        yield


def _identity_move(model: torch.nn.Module):  # noqa: ANN202
    """`model.to(device)` onto the device the fake model already lives on: the identity, as it is for real tensors.

    torch's `Module._apply` always swaps a FakeTensor parameter for a new one (`torch.utils.swap_tensors`), which
    fails because FakeTensorMode's converter holds a weak reference to every fake parameter; DeepSpeed's engines
    call `module.to(engine.device)` on the model they are given. Any other conversion is left to torch."""
    move = type(model).to.__get__(model)

    def to(*args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None and device is not None and torch.device(device).type == "cpu":
            return model
        return move(*args, **kwargs)

    return to


def _inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that hold `t`'s memory: itself, or a wrapper subclass's inner tensors (recursively)."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _inner_tensors(inner)
    else:
        yield t


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameters/gradients), else the tensor."""
    return getattr(t, "_local_tensor", t)


def simulate_config(cfg: RunConfig) -> RunConfig:
    """The configuration actually executed: compiled methods through aot_eager (see the module docstring)."""
    if cfg.method in UNSUPPORTED:
        raise SimulationError(f"--method {cfg.method} cannot be simulated: {UNSUPPORTED[cfg.method]}")
    return cfg.replace(device="cpu", compile_backend=SIMULATED_BACKEND, memory_budget=None)


#: predictions made in this process, by (configuration, allocator blocks): devices that round alike share them
_PREDICTIONS: dict[tuple[str, int, int], tuple[RankPeak, dict[str, Any]]] = {}


def predict_peak(cfg: RunConfig, device: DeviceModel) -> tuple[RankPeak, dict[str, Any]]:
    """Rank 0's peak at the model's full depth: simulated whole, or at 2 and 3 layers and extrapolated."""
    key = (cfg.config_hash(), device.small_block_bytes, device.large_block_bytes)
    if key not in _PREDICTIONS:
        _PREDICTIONS[key] = _predict_peak(cfg, device)
    return _PREDICTIONS[key]


def _predict_peak(cfg: RunConfig, device: DeviceModel) -> tuple[RankPeak, dict[str, Any]]:
    from autosp.models import get_preset

    run_cfg = simulate_config(cfg)
    depth = get_preset(cfg.model).num_layers
    try:
        if depth <= EXACT_LAYERS:
            return _rank_peak(run_cfg, device), {"layers_simulated": [depth], "extrapolated": False}
        if cfg.method in NOT_LINEAR_IN_DEPTH:
            return _rank_peak(run_cfg, device), {"layers_simulated": [depth], "extrapolated": False,
                                                 "note": f"{NOT_LINEAR_IN_DEPTH[cfg.method]}: simulated whole"}
        pair = SECOND_PAIR if _layers_reach_their_neighbours(cfg) else (2, 3)
        runs = [_rank_peak(run_cfg, device, layers) for layers in pair]
        peak, note = _extrapolate(*runs, depth)
        if peak is None and pair != SECOND_PAIR and depth > SECOND_PAIR[1]:
            runs.append(_rank_peak(run_cfg, device, SECOND_PAIR[1]))
            peak, later = _extrapolate(*runs[-2:], depth)
            note = f"{note}; extrapolated from 3 and 4 layers" if peak is not None else f"{note}; {later}"
        if peak is None:
            return _rank_peak(run_cfg, device), {"layers_simulated": [depth], "extrapolated": False,
                                                 "note": f"{note}: simulated whole"}
    except SimulationError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the method on fake tensors is reported, not guessed
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        # the method's own refusal (it would refuse the real run alike) vs a failure of the simulation itself
        what = "refuses this configuration" if isinstance(exc, AutoSPError) else "cannot run on fake tensors"
        raise SimulationError(f"--method {cfg.method} {what}: {type(exc).__name__}: {first}") from exc
    low, high = runs[-2:]
    how = {"layers_simulated": [run.num_layers for run in runs], "extrapolated": True,
           "extrapolated_from": [low.num_layers, high.num_layers],
           "per_layer_peak_bytes": high.phases[peak.peak_phase].peak_bytes - low.phases[peak.peak_phase].peak_bytes}
    if peak.peak_phase != high.peak_phase:
        note = f"{note}; " if note else ""
        note += f"at {depth} layers the {peak.peak_phase} peak overtakes the {high.peak_phase} one"
    return peak, {**how, "note": note} if note else how


#: methods whose peak is not linear in the depth, simulated whole. DeepSpeed's ZeRO-3 gathers, prefetches and
#: releases parameters in buckets of elements, not by layer (and caps its buckets at the model's parameter count):
#: llama-3.2-3b at 12K on an a100-80gb, 2 and 3 layers extrapolated to 74.5 GiB at the same op, 28 layers simulated
#: 70.5 GiB (saved activations 54.2 vs 50.1 GiB; per-layer peak steps of 1.90-1.93, then 1.76 GiB from 6 to 7 layers)
NOT_LINEAR_IN_DEPTH = {"zero3": "DeepSpeed ZeRO-3's peak is not linear in the depth (element-sized buckets)"}
#: the depths extrapolated from when 2 and 3 layers peak at different ops: a 2-layer model has no inner layer
SECOND_PAIR = (3, 4)
#: the baselines sharded by FSDP2 (`baselines.fsdp_sharding`), by the ZeRO stages at which they are
FSDP2_SHARDED = {"fsdp": (3,), "ulysses": (3,), "ring": (3,)}


def _layers_reach_their_neighbours(cfg: RunConfig) -> bool:
    """Whether a layer's program reaches into the next layers' (FSDP2 prefetches the next layer's parameters in
    forward and backward and reduce-scatters the previous one's gradients), so that a 2-layer model, all boundary,
    is off the line even where it peaks at the op of the same name (fsdp on a 6-layer wide `tiny-mha`, mi250-gcd,
    128 tokens: the 2-3 line said 17,460,224 B, 6 layers simulated 17,368,064, the 3-4 line exact; ring ZeRO-3 on
    llama-2-13b at 18K, mi250-gcd: an `empty_like` at 2, 3 and 4 layers, the 2-3 line 66.8 GiB at 40 layers, the
    3-4 line 43.4): such programs start from 3 and 4."""
    from baselines.base import get_strategy

    return get_strategy(cfg.method).zero_stage(cfg) in FSDP2_SHARDED.get(cfg.method, ())


def _extrapolate(low: RankPeak, high: RankPeak, depth: int) -> tuple[RankPeak | None, str | None]:
    """The peak at `depth` layers from two runs one layer apart, phase by phase, or why that cannot be done.

    Layers are identical, so at an op at a fixed place relative to the layers (e.g. the last layer's backward)
    every term - model state, gradients, saved activations, the transient working set - grows by the same bytes
    per layer. Each phase's peak and terms are extrapolated along their own line, and the highest phase at
    `depth` wins: with depth, the optimizer step (state, gradients and AdamW's multi-tensor temporary) can
    overtake a backward peak that short models reach in the logits' or the embedding's gradient. The line is
    that of one op only if the winning phase peaks at the same op in both runs (and no term of it goes negative:
    seen for DeepSpeed's ZeRO-3, `NOT_LINEAR_IN_DEPTH`); if not, None."""
    if list(low.phases) != list(high.phases):
        return None, f"the phases differ at {low.num_layers} and {high.num_layers} layers"
    more = depth - high.num_layers

    def line(name: str, term: str) -> int:
        later = getattr(high.phases[name], term)
        return later + more * (later - getattr(low.phases[name], term))

    phases = {name: PhasePeak(**{term: line(name, term) for term in LINEAR_TERMS}, peak_op=phase.peak_op)
              for name, phase in high.phases.items()}
    winner = max(phases, key=lambda name: phases[name].peak_bytes)  # a tie: the earlier phase, as the tracker
    ops = (low.phases[winner].peak_op, high.phases[winner].peak_op)
    if ops[0] != ops[1]:
        return None, f"{winner} peak op differs at {low.num_layers} and {high.num_layers} layers ({ops[0]} / {ops[1]})"
    if negative := [term for term in LINEAR_TERMS if getattr(phases[winner], term) < 0]:  # no line, then
        return None, (f"{winner} {negative[0]} extrapolates below zero from {low.num_layers} and "
                      f"{high.num_layers} layers")
    return RankPeak(**vars(phases[winner]), peak_phase=winner, num_layers=depth,
                    ops=high.ops + more * (high.ops - low.ops),
                    host_offloaded_bytes=high.host_offloaded_bytes + more * (high.host_offloaded_bytes
                                                                             - low.host_offloaded_bytes),
                    assumed_healthy_reads=high.assumed_healthy_reads, phases=phases), None


def simulate(cfg: RunConfig, device: DeviceModel) -> dict[str, Any]:
    """A `mode: simulated` record of `cfg` on `device`: predicted per-rank peak, status ok/oom/error."""
    from autosp.harness.records import new_record
    from autosp.harness.runner import validate

    strategy, sp_size = validate(cfg.replace(device="cpu"))
    record = new_record(cfg, sp_size=sp_size, mode="simulated", zero=strategy.zero_stage(cfg))
    record.update(device=device.name, device_name=f"simulated {device.name}", memory_budget=device.usable_bytes)
    started = time.monotonic()
    try:
        peak, how = predict_peak(cfg, device)
    except SimulationError as exc:
        record.update(status="error", error=str(exc))
        record["extra"]["wall_s"] = round(time.monotonic() - started, 3)
        return record
    total = peak.peak_bytes + device.fixed_bytes
    record.update(status="ok" if total <= device.usable_bytes else "oom", peak_mem_bytes=total,
                  peak_mem_by_rank=[total])
    if record["status"] == "oom":
        record["error"] = f"predicted peak {format_size(total)} exceeds {device.name}'s {format_size(device.usable_bytes)}"
    record["extra"].update(
        simulated=True, simulated_rank=0, wall_s=round(time.monotonic() - started, 3),
        executed_backend=DIRECT_INDUCTOR_BACKEND if cfg.method == "ds-autosp" else SIMULATED_BACKEND, assumed_healthy_reads=peak.assumed_healthy_reads,
        fusion="none: every intermediate of the partitioned graphs is materialised (as aot_eager runs them)",
        breakdown={**{name: getattr(peak, name) for name in COMPONENTS},
                   "live_tensor_bytes": peak.live_tensor_bytes, "allocator_blocks_bytes": peak.peak_bytes,
                   "context_bytes": device.context_bytes, "workspace_bytes": device.workspace_bytes,
                   "peak_op": peak.peak_op, "peak_phase": peak.peak_phase,
                   "host_offloaded_bytes": peak.host_offloaded_bytes},
        **how)
    return record


def curve_hint(curve: dict[int, int], tensor_budget: int, granularity: int) -> int | None:
    """Where the line through the two simulated lengths whose peaks lie nearest `tensor_budget` crosses it.

    `curve`: length -> allocator-charged tensor peak (no context) of earlier probes of the same configuration,
    e.g. a search for another device type. Only a first length to probe: the statuses of the probes decide.
    The second point lies at least an eighth of the length away when there is one: the slope between two
    lengths one granularity step apart is dominated by allocator rounding (seen: 0.21 vs 0.31 GiB per 1K)."""
    if len(curve) < 2:
        return None
    distance = lambda n: (abs(curve[n] - tensor_budget), n)  # noqa: E731
    first = min(curve, key=distance)
    far = [n for n in curve if abs(n - first) >= max(granularity, first // 8)]
    second = min(far or [n for n in curve if n != first], key=distance)
    (s1, p1), (s2, p2) = sorted((n, curve[n]) for n in (first, second))
    if p2 <= p1:
        return None
    return max(granularity, int((s1 + (tensor_budget - p1) * (s2 - s1) / (p2 - p1)) // granularity) * granularity)


def simulated_search(cfg: RunConfig, device: DeviceModel, *, granularity: int | None = None,
                     min_len: int | None = None, max_len: int = 1 << 20,
                     curve: dict[int, int] | None = None) -> dict[str, Any]:
    """Longest trainable length on `device` by `autosp search`'s own search, each probe a simulation.

    The search starts where `curve` (the peaks simulated so far for this configuration, extended by this
    search's probes) says the device's budget is reached, else at the analytic floor's limit: with peaks
    close to linear in the length, a search for a second device type needs about two probes (the answer and
    one granularity step above), and every probe already simulated at a length is reused (`predict_peak`)."""
    from autosp.experiments.search import FOUND, NO_OOM_UP_TO_MAX, OOM_AT_MIN, default_granularity, search_max_length

    granularity = granularity or default_granularity(cfg.world_size)
    curve = {} if curve is None else curve
    probes: list[dict[str, Any]] = []
    started = time.monotonic()
    limit, floor = _floor_limit(cfg, device.usable_bytes - device.fixed_bytes, granularity)

    def probe(seq_len: int) -> tuple[str, int | None, int | None]:
        record = simulate(cfg.replace(seq_len=seq_len), device)
        probes.append(record)
        if record["status"] not in ("ok", "oom"):
            return record["status"], None, None
        breakdown = record["extra"]["breakdown"]
        curve[seq_len] = breakdown["allocator_blocks_bytes"]
        # model state at the peak is what was resident at the step's start: the line's value at length 0
        return record["status"], record["peak_mem_bytes"], breakdown["model_state_bytes"] + device.fixed_bytes

    start = curve_hint(curve, device.usable_bytes - device.fixed_bytes, granularity) or limit
    with shared_rank_programs():
        outcome = search_max_length(probe, granularity=granularity, min_len=min_len or granularity,
                                    max_len=max_len, budget=device.usable_bytes, start_len=start)
    best = next((r for r in reversed(probes) if r["seq_len"] == outcome.max_seq_len), None)
    row = dict(best if best is not None else probes[-1])
    row.update(kind="search", seq_len=outcome.max_seq_len or 0, status=outcome.status,
               max_seq_len=outcome.max_seq_len, first_oom_seq_len=outcome.first_oom_seq_len,
               granularity=granularity, num_probes=len(outcome.probes),
               probes=[{"seq_len": r["seq_len"], "status": r["status"], "peak_mem_bytes": r["peak_mem_bytes"]}
                       for r in probes],
               wall_s=round(time.monotonic() - started, 3))
    row.update(floor_limit_seq_len=limit, floor=floor,
               achieved_over_limit=(outcome.max_seq_len / limit) if (limit and outcome.max_seq_len) else None)
    if outcome.status in (FOUND, NO_OOM_UP_TO_MAX, OOM_AT_MIN):
        row["error"] = None
    else:
        row["error"] = probes[-1]["error"]
    row["run_id"] = row["search_id"] = uuid.uuid4().hex
    return row


def _floor_limit(cfg: RunConfig, budget: int, granularity: int) -> tuple[int | None, dict | None]:
    """The analytic memory floor's longest length for the tensor budget (as `autosp search` reports it)."""
    from autosp.experiments.floor import run_floor

    try:
        floor = run_floor(cfg)
    except ConfigError:
        return None, None
    return floor.max_seq_len(budget, granularity), floor.to_dict()


def _summary(record: dict[str, Any]) -> str:
    head = f"{record['method']} {record['model']} P={record['world_size']} on {record['device']} (simulated)"
    if record["status"] == "error":
        return f"{head}: error: {record['error']}"
    b = record["extra"].get("breakdown", {})
    parts = ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {format_size(b[k])}" for k in COMPONENTS if k in b)
    detail = (f"peak {format_size(record['peak_mem_bytes'])} of {format_size(record['memory_budget'])} "
              f"[{parts}; at {b.get('peak_op')} in {b.get('peak_phase')}]")
    if record.get("kind") == "search":
        return f"{head}: {record['status']}, max_seq_len={record['max_seq_len']} ({record['num_probes']} probes, " \
               f"{record['wall_s']:.0f} s); at that length {detail}"
    return f"{head} seq {record['seq_len']}: {record['status']}: {detail} ({record['extra']['wall_s']:.1f} s)"


def _cmd_simulate(args: argparse.Namespace) -> int:
    from autosp.harness.flags import run_config_from_args

    if (args.seq_len is None) == (not args.search):
        raise ConfigError("give exactly one of --seq-len S or --search")
    devices = [get_device_model(name, None) for name in args.sim_device.split(",")] if args.memory_budget is None \
        else [get_device_model(name, _budget(args)) for name in args.sim_device.split(",")]
    args.device = "cpu"  # the simulation runs on this CPU; --device named the simulated device type
    cfg = run_config_from_args(args, seq_len=args.seq_len or 1)
    curve: dict[int, int] = {}  # one configuration's peaks, shared by the searches for every device type
    with shared_rank_programs():
        return _simulate_devices(args, cfg, devices, curve)


def _simulate_devices(args: argparse.Namespace, cfg: RunConfig, devices: list[DeviceModel],
                      curve: dict[int, int]) -> int:
    from autosp.harness.records import append_record

    status = 0
    for device in devices:
        record = simulated_search(cfg, device, granularity=args.granularity, max_len=args.max_len, curve=curve) \
            if args.search else simulate(cfg, device)
        append_record(args.out, record)
        print(_summary(record) + f" -> {args.out}", flush=True)
        status = max(status, 1 if record["status"] == "error" else 0)
    return status


#: what identifies one cell of the validation: the same run, measured and simulated
VALIDATION_KEY = ["method", "model", "world_size", "seq_len", "dtype", "batch_size"]


def validation_table(records: "pd.DataFrame") -> "pd.DataFrame":
    """Simulated vs measured per-rank peak for every configuration with both (CPU meter vs `cpu` device)."""
    import pandas as pd

    runs = records[records["kind"].isna()] if "kind" in records else records
    runs = runs[(runs["device"] == "cpu") & (runs["status"] == "ok")]
    measured = runs[runs["mode"] == "measured"].drop_duplicates(VALIDATION_KEY, keep="last")
    simulated = runs[runs["mode"] == "simulated"].drop_duplicates(VALIDATION_KEY, keep="last")
    table = measured[VALIDATION_KEY + ["peak_mem_bytes"]].merge(
        simulated[VALIDATION_KEY + ["peak_mem_bytes", "extra.breakdown.peak_op"]], on=VALIDATION_KEY,
        suffixes=("_measured", "_simulated"))
    table["error"] = (table["peak_mem_bytes_simulated"] - table["peak_mem_bytes_measured"]) \
        / table["peak_mem_bytes_measured"]
    table["within_10pct"] = table["error"].abs() <= 0.10
    return pd.DataFrame(table).sort_values(["model", "world_size", "method", "seq_len"]).reset_index(drop=True)


def _cmd_simulate_check(args: argparse.Namespace) -> int:
    from autosp.experiments.tables import format_table
    from autosp.harness.records import load_records

    table = validation_table(load_records(args.inputs))
    if table.empty:
        raise ConfigError("no configuration was both measured (autosp run) and simulated (--device cpu) in --in")
    print(format_table(table))
    print(f"{int(table['within_10pct'].sum())}/{len(table)} cells within 10%, max |error| "
          f"{table['error'].abs().max():.2%}")
    return 0 if table["within_10pct"].all() else 1


def _budget(args: argparse.Namespace) -> int:
    from autosp.harness.measure import parse_size

    return parse_size(args.memory_budget)


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp simulate --method M --model X --device a100-80gb --world-size P (--seq-len S | --search)`."""
    from autosp.harness.flags import add_run_config_arguments

    p = subparsers.add_parser(
        "simulate", help="predict one rank's peak memory (or max trainable length) on a GPU type, on fake tensors",
        epilog="exit code: 0 predicted (ok or oom), 1 the method cannot be simulated, 2 bad input")
    add_run_config_arguments(p, varied=("seq_len",))
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence to predict the peak for")
    p.add_argument("--search", action="store_true", help="longest trainable length (autosp search's logic)")
    p.add_argument("--granularity", type=int, default=None, help="search length step (default 2*P*128)")
    p.add_argument("--max-len", type=int, default=1 << 22, help="longest length the search tries")
    p.add_argument("--out", default="results/simulated.jsonl", help="JSONL file the records are appended to")
    p.set_defaults(func=_cmd_simulate)
    # --device names the simulated device type here (a catalogue entry, comma-separated for several)
    for action in p._actions:
        if action.dest == "device":
            action.dest, action.default = "sim_device", "a100-80gb"
            action.help = ("device type(s) to simulate, comma-separated: " + ", ".join(_catalogue_names()))


    p = subparsers.add_parser("simulate-check", help="simulated vs measured CPU peaks of the same runs (validation)",
                              epilog="exit code: 0 every cell within 10%%, 1 not, 2 no pairs")
    p.add_argument("--in", dest="inputs", nargs="+", required=True, help="JSONL files with both kinds of records")
    p.set_defaults(func=_cmd_simulate_check)


def _catalogue_names() -> list[str]:
    from autosp.experiments.devices import device_catalogue

    return list(device_catalogue())
