"""Rank r's program at one depth (`RankProgram`: model, method and AdamW state built once, stepped at any length),
and the cache that lets a search's probes share it (`shared_rank_programs`)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from autosp.compiler.memory import planning_rates
from autosp.experiments.simulate.adapters import (
    RealTwins,
    alst_data_answers,
    deepspeed_autosp_per_length,
    deepspeed_hooks_clocked,
    deepspeed_optimizer_offload,
    deepspeed_rank0_answers,
    hf_packed_sequences_answered,
    host_optimizer_state,
    identity_move,
    inductor_compile_unfused,
    optimizer_implementation_of,
)
from autosp.experiments.simulate.clock import StepClock
from autosp.experiments.simulate.devices import DeviceModel
from autosp.experiments.simulate.elsewhere import DepthElsewhere
from autosp.experiments.simulate.tracker import LiveStorageTracker, PeakMoment, PhasePeak, RankPeak, local_shard
from autosp.experiments.simulate.world import (
    fake_world,
    install_registrations,
    keep_deepspeed_splice,
    keep_hf_registries,
    process_registrations,
    registrations_installed,
)
from autosp.harness.config import RunConfig
from autosp.timing import DeviceRates


def _fake_batch(real: Any, count: int, fake_mode: Any, tracker: LiveStorageTracker, twins: RealTwins) -> Any:
    """The global batch as fake tensors, each with its real twin; its valid-label count (data, not shape) read from
    the real one."""
    from autosp.models.data import Batch

    class CountedBatch(Batch):
        def num_valid_labels(self) -> int:
            return count

    fields = {k: None if v is None else fake_mode.from_tensor(v) for k, v in real.model_kwargs().items()}
    batch = CountedBatch(**fields)
    for name, t in fields.items():
        if t is not None:
            tracker.track(t)
            twins.add(t, getattr(real, name))
    return batch


@contextlib.contextmanager
def _local_world_size(ranks: int) -> Iterator[None]:
    """LOCAL_WORLD_SIZE as a node of the simulated device sets it (`measure.ranks_on_this_node`), then as it was."""
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before


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
        with self.fake_mode, tracker, deepspeed_autosp_per_length(shared and cfg.method == "ds-autosp"), \
                deepspeed_optimizer_offload(tracker, device), host_optimizer_state(tracker):
            torch.manual_seed(cfg.seed)
            self.model = build_model(cfg.model, seed=cfg.seed, dtype=DTYPES[cfg.dtype], num_layers=self.layers)
            self.model.to = identity_move(self.model)
            keep_hf_registries()
            # the device's tensor memory is the memory planner's budget (autosp --sac auto), as on a real device,
            # and its node's host memory the host budget, shared by the node's ranks
            tensor_memory = device.usable_bytes - device.fixed_bytes
            planned = cfg.replace(memory_budget=tensor_memory if cfg.memory_budget is None else cfg.memory_budget,
                                  host_memory_budget=cfg.host_memory_budget or device.host_bytes_per_node)
            before = process_registrations()
            # the setup decides where the optimizer state lives by how AdamW steps on the device (`autosp.api`)
            with _local_world_size(device.ranks_per_node(cfg.world_size)), optimizer_implementation_of(device):
                self.step = self.strategy.setup(self.model, self.ctx, planned)
            # what the setup registered process-wide (alst: its SP groups and Ulysses wrapper) is this program's,
            # installed around its steps; the next program's setup (another depth or device) starts from before
            self.registrations = process_registrations()
            install_registrations(before)
        keep_deepspeed_splice()  # the next engine of this cell (another depth) shares this one's splice

    def measure(self, cfg: RunConfig) -> RankPeak:
        """The peak of one measured step (forward, backward, AdamW) at cfg.seq_len."""
        from autosp.harness.runner import global_batch, nonfinite_gradient

        real_batch = global_batch(cfg, self.sp_size)
        valid_labels = real_batch.num_valid_labels()  # data, not shape: read before tensors turn fake
        tracker, step, model = self.tracker, self.step, self.model
        ops, assumed_reads = tracker.ops, tracker.assumed_reads  # this call's counts, warm-up included
        records = getattr(getattr(step, "compiled", None), "partition_records", None)  # an autosp step's
        compiled_before = len(records) if records is not None else 0
        with self.fake_mode as fake_mode, tracker, contextlib.ExitStack() as stack:
            if self.shared:  # one symbolic trace serves every length; past the recompile limit fail, never run eager
                stack.enter_context(torch.compiler.config.patch(dynamic_sources=DYNAMIC_SEQUENCE_SOURCES))
                stack.enter_context(torch._dynamo.config.patch(fail_on_recompile_limit_hit=True))
            stack.enter_context(registrations_installed(self.registrations))
            stack.enter_context(planning_rates(_gpu_rates(tracker.device)))
            stack.enter_context(deepspeed_rank0_answers(self.rank))
            stack.enter_context(inductor_compile_unfused())
            stack.enter_context(optimizer_implementation_of(tracker.device))
            stack.enter_context(deepspeed_optimizer_offload(tracker, tracker.device))
            stack.enter_context(deepspeed_hooks_clocked(tracker))
            stack.enter_context(host_optimizer_state(tracker))
            twins = RealTwins()
            stack.enter_context(alst_data_answers(twins, tracker, valid_labels))
            stack.enter_context(hf_packed_sequences_answered(twins))
            batch = _fake_batch(real_batch, valid_labels, fake_mode, tracker, twins)
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
            def book(p: torch.nn.Parameter) -> None:
                """A gradient, counted; a compiled backward also fires this hook, with no gradient, for a parameter it
                gives none (DeepSeek-V3.2's indexer, run under no_grad)."""
                if p.grad is not None:
                    gradients.add(tracker.track(local_shard(p.grad)))

            hooks = [p.register_post_accumulate_grad_hook(book) for p in model.parameters() if p.requires_grad]

            def pack(t: torch.Tensor) -> torch.Tensor:
                # the step's own tensors only: a shared program compiles a new length inside its measured step,
                # and aot_autograd's tracing there saves tensors of its own fake mode
                if getattr(local_shard(t), "fake_mode", None) is fake_mode:
                    saved.add(tracker.track(local_shard(t)))
                return t

            tracker.phase = "forward"
            tracker.reset_peak()
            tracker.clock = StepClock()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                step.forward_backward(batch)
            tracker.phase = "optimizer"
            with tracker.assume_healthy_step():
                with tracker.known_boolean_reads(True):  # the measured step's finite check, priced too: a healthy
                    nonfinite_gradient(step)             # step's gradients are finite (its answer read as a number)
                step.optimizer_step()
            for hook in hooks:
                hook.remove()
            tracker.watching = False
            trace, tracker.clock = tracker.clock.trace, None
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
        records = getattr(getattr(step, "compiled", None), "partition_records", None)
        plans = [r.plan for r in (records or [])[compiled_before:] if r.plan is not None]
        peak = tracker.peak()
        peak_phase = next(phase for phase, moment in tracker.moments.items() if moment is peak)
        # what backward re-runs: the planner's count per graph, or the method's own (`TrainStep.recompute_flops`)
        recompute = sum(p["recompute_flops"] for p in plans) if plans else getattr(step, "recompute_flops", None)
        return RankPeak(**vars(phases[peak_phase]), peak_phase=peak_phase, num_layers=self.layers,
                        ops=tracker.ops - ops, host_offloaded_bytes=tracker.host_peak,
                        assumed_healthy_reads=tracker.assumed_reads - assumed_reads, phases=phases, plans=plans,
                        recompute_flops=recompute, trace=trace)


def _gpu_rates(device: DeviceModel) -> DeviceRates | None:
    """The rates autosp's planner ranks its plans on (`time_rank`) when compiling for `device`: a GPU's catalogue
    row; None on the cpu device, where a measured CPU run's planner has none either (its plans must agree)."""
    from autosp.timing.rates import RatesError, device_rates

    if device.vendor == "cpu":
        return None
    try:
        return device_rates(device.name)
    except RatesError:
        return None


#: methods whose rank program is kept across the lengths of a search (`shared_rank_programs`): their state at the
#: start of a measured step does not depend on the lengths stepped before (tests/experiments/test_simulate.py).
#: DeepSpeed's engines (zero3, ds-autosp) qualify too: what they keep across steps (ZeRO-3's partitions, its
#: gradient buckets and the prefetch trace of the module order, recorded in the warm-up step; ds-autosp's one
#: Dynamo trace of a sequence dimension it marks dynamic itself, compiled by DeepSpeed's backend per length:
#: `deepspeed_autosp_per_length`) is sized by the parameters, not by the length; alst's too (ZeRO-3, and Ulysses
#: registered for a variable length).
SHARED_PROGRAM_METHODS = ("autosp", "ulysses", "ring", "fsdp", "zero3", "ds-autosp", "alst")
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
        slot = (layers, device.small_block_bytes, device.large_block_bytes, device.usable_bytes - device.fixed_bytes)
        if slot not in self.programs:
            self.programs[slot] = RankProgram(cfg, device, num_layers=layers, shared=True)
        return self.programs[slot]

    def close(self) -> None:
        self.programs.clear()
        self.world.close()
        self.key = None


@dataclass
class _DepthScope:
    """One `deeper_programs_elsewhere` scope: its depth process (spawned at the scope's first pair, None until
    then or after a failed pair) and the CPU seconds spent there so far."""

    process: DepthElsewhere | None = None
    cpu_s: float = 0.0


_SHARED: list[_SharedPrograms] = []  # the active scope of `shared_rank_programs`, if any
_DEEPER: list[_DepthScope] = []  # the active scope of `deeper_programs_elsewhere`, if any


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


@contextlib.contextmanager
def deeper_programs_elsewhere(jobs: int) -> Iterator[None]:
    """Inside a `shared_rank_programs` scope, with `jobs` >= 2: `rank_peaks` runs the deepest program of each pair
    in a second process (`elsewhere.DepthElsewhere`, spawned at the first pair) while this one runs the others."""
    if jobs < 2 or _DEEPER or not _SHARED:
        yield
        return
    _DEEPER.append(_DepthScope())
    try:
        yield
    finally:
        scope = _DEEPER.pop()
        if scope.process is not None:
            scope.process.close()


def cpu_elsewhere() -> float:
    """CPU seconds the depth process of `deeper_programs_elsewhere` has spent so far (0 outside it)."""
    return _DEEPER[0].cpu_s if _DEEPER else 0.0


def rank_peaks(cfg: RunConfig, device: DeviceModel, depths: tuple[int, ...]) -> list[RankPeak]:
    """`rank_peak` at each depth; inside `deeper_programs_elsewhere` the deepest in its process, at once."""
    if not _DEEPER or len(depths) < 2 or cfg.method not in SHARED_PROGRAM_METHODS:
        return [rank_peak(cfg, device, layers) for layers in depths]
    scope = _DEEPER[0]
    if scope.process is None:
        scope.process = DepthElsewhere()
    *here, deepest = depths
    scope.process.start(cfg, device, deepest)
    try:
        peaks = [rank_peak(cfg, device, layers) for layers in here]
    except BaseException:
        scope.process.close(wait=False)  # its programs go too; the next pair spawns a fresh process
        scope.process = None
        raise
    peak, cpu_s = scope.process.result()
    scope.cpu_s += cpu_s
    return [*peaks, peak]


def set_up_program(cfg: RunConfig, device: DeviceModel) -> None:
    """Inside `shared_rank_programs`: `cfg`'s whole-depth program set up at `cfg.seq_len`, not stepped, as a search's
    first probe of a configuration sets it up; its later probes at other lengths then step that program."""
    from autosp.models import get_preset

    _SHARED[0].get(cfg, device, get_preset(cfg.model).num_layers)


def rank_peak(cfg: RunConfig, device: DeviceModel, layers: int | None = None) -> RankPeak:
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
