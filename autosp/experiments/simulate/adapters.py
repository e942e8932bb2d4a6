"""What the simulator sets around a program so it runs on fake tensors as it would on the device: the optimizer
implementation the device would pick, DeepSpeed's inductor compile unfused, DeepSpeed's AutoSP per length, rank 0's
answers to DeepSpeed's consistency checks, `Module.to` as the identity (each exact or stated in the record)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from autosp.experiments.simulate.config import DIRECT_INDUCTOR_BACKEND, SimulationError
from autosp.experiments.simulate.devices import DeviceModel


@contextlib.contextmanager
def optimizer_implementation_of(device: DeviceModel) -> Iterator[None]:
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
def inductor_compile_unfused() -> Iterator[None]:
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
def deepspeed_autosp_per_length(shared: bool) -> Iterator[None]:
    """A shared ds-autosp program compiles DeepSpeed's AutoSP backend per length on its one Dynamo trace
    (`autosp.experiments.simulate.deepspeed_per_length`): the engine set up here gets it from `init_autosp`."""
    if not shared:
        yield
        return
    from unittest import mock

    from deepspeed.compile import init_sp

    from autosp.experiments.simulate.deepspeed_per_length import per_length

    backend_of = init_sp.init_autosp
    with mock.patch.object(init_sp, "init_autosp", lambda config: per_length(backend_of(config))):
        yield


@contextlib.contextmanager
def deepspeed_rank0_answers(rank: int) -> Iterator[None]:
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
        raise SimulationError(
            "DeepSpeed's engines are simulated as rank 0 only (their checks broadcast rank 0's lists)")
    with mock.patch.object(utils, "get_lst_from_rank0", list), \
            mock.patch.object(utils, "assert_lst_len_same_as_other_ranks", lambda lst: None):
        yield


def identity_move(model: torch.nn.Module):  # noqa: ANN202
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


class RealTwins:
    """The real tensors behind fake ones: the simulator makes the batch fake from a real batch, and a program's own
    pure function of it can be run on the real twin too. A view of a fake tensor is answered with the same view
    (size, strides, storage offset) of its twin, so data a method reads off its inputs comes from the real values
    they stand for. Keyed by storage, held weakly: a twin never keeps a fake tensor (and its bytes) alive."""

    def __init__(self) -> None:
        self.twins: dict[int, tuple[Any, torch.Tensor]] = {}

    def add(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        import weakref

        storage = fake.untyped_storage()
        self.twins[id(storage)] = (weakref.ref(storage), real)

    def has(self, fake: torch.Tensor) -> bool:
        """Whether `fake` is a view of a tensor added here."""
        storage = fake.untyped_storage()
        ref, _ = self.twins.get(id(storage), (None, None))
        return ref is not None and ref() is storage

    def real(self, fake: torch.Tensor) -> torch.Tensor:
        """The real values of `fake` (a view of a tensor added here); call it under `real_values()`."""
        storage = fake.untyped_storage()
        ref, real = self.twins.get(id(storage), (None, None))
        if ref is None or ref() is not storage:
            raise SimulationError("a data-dependent read of a tensor that is not a view of the simulated batch")
        return real.as_strided(fake.shape, fake.stride(), fake.storage_offset())


def real_values() -> contextlib.AbstractContextManager:
    """Ops on real tensors as on real tensors: the fake mode and the storage tracker off (neither sees them)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


@contextlib.contextmanager
def hf_packed_sequences_answered(twins: RealTwins) -> Iterator[None]:
    """HF's `find_packed_sequence_indices` (are the position ids several packed sequences?) answered from the real
    position ids, for every HF model the simulator runs (`single`, `single[ac=layer]`, alst, ...).

    On a fake tensor HF says "tracing, cannot tell" and builds the full [B, 1, S, S] causal mask, so SDPA runs
    with an explicit mask (the math path, S x S attention weights saved per head); on the real position ids of the
    batch (one sequence per row) it answers None and SDPA runs causal without a mask, as on the device. (This
    decides alst's one-rank recipe: at 32K tokens a 2 GiB mask.) Position ids that are no view of the batch were
    made by the model from the length (HF's `cache_position`, an arange): one sequence per row, None. Inside a
    compiled method's trace HF answers itself."""
    import sys
    from unittest import mock

    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    find_packed = masking.find_packed_sequence_indices

    def packed_from_real(position_ids: torch.Tensor) -> torch.Tensor | None:
        if torch.compiler.is_compiling():  # a compiled method's trace: its masks are its own (autosp: `masks`)
            return find_packed(position_ids)
        if not twins.has(position_ids):  # made by the model from the sequence length (cache_position): one sequence
            return None
        with real_values():
            packed = find_packed(twins.real(position_ids))
        return None if packed is None else find_packed(position_ids)

    with mock.patch.object(masking, "find_packed_sequence_indices", packed_from_real):
        yield


@contextlib.contextmanager
def alst_data_answers(twins: RealTwins, tracker: Any, valid_labels: int) -> Iterator[None]:
    """The reads of data in alst's step, answered as the real run would (only once an alst program was set up:
    its setup imports DeepSpeed's `ulysses_sp`):

    - `agreed_mlp_shards` (TiledMLP's shard count, ceil(S_local / hidden) all-reduced to the maximum over ranks
      and read with `.item()`): ceil(S_local / hidden) from the shapes. Exact: `shard_like_the_adapter` cuts the
      sequence into equal chunks, so every rank holds the same S_local and the maximum is this rank's value (the
      real run's 8-byte count tensor is not allocated here).
    - `no_valid_labels` (ArcticTraining's `all(shift_labels == -100)` per logits tile): alst's own test on the
      real labels of that tile. `shard_like_the_adapter` runs on the fake batch, as alst runs it, and on its real
      twin, so each fake tile of the shifted labels has real values.
    - DeepSpeed's `TiledFusedLogitsLoss.backward` asks `grads[0] != 1.0` (whether to scale the hidden states'
      gradient, in place): the gradient reaching alst's summed loss is 1 / (valid labels of the SP group's
      sequence), so the answer is True unless exactly one label of the whole batch is valid (a data-parallel
      replica's own count is not read). Either answer allocates nothing (an in-place multiply).
    - HF's `find_packed_sequence_indices`: `hf_packed_sequences_answered` (every HF model's)."""
    import sys
    from unittest import mock

    alst = sys.modules.get("baselines.alst")
    ulysses_sp = sys.modules.get("deepspeed.runtime.sequence_parallel.ulysses_sp")
    if alst is None or ulysses_sp is None:
        yield
        return
    shard, no_valid = alst.shard_like_the_adapter, alst.no_valid_labels

    def shard_with_twins(batch: Any, sp_rank: int, sp_size: int) -> dict[str, torch.Tensor]:
        from autosp.models.data import Batch

        fake = shard(batch, sp_rank, sp_size)
        with real_values():
            real = shard(Batch(**{k: None if v is None else twins.real(v) for k, v in batch._fields().items()}),
                         sp_rank, sp_size)
        for name, tensor in fake.items():
            twins.add(tensor, real[name])
        return fake

    def no_valid_real(labels: torch.Tensor) -> bool:
        with real_values():
            return no_valid(twins.real(labels))

    TiledFusedLogitsLoss = ulysses_sp.TiledFusedLogitsLoss  # noqa: N806 - DeepSpeed's class
    loss_backward = TiledFusedLogitsLoss.backward

    def loss_backward_answered(ctx: Any, *grads: torch.Tensor) -> Any:
        with tracker.known_boolean_reads(valid_labels != 1):
            return loss_backward(ctx, *grads)

    with mock.patch.object(alst, "agreed_mlp_shards", lambda x: -(-x.shape[-2] // x.shape[-1])), \
            mock.patch.object(alst, "no_valid_labels", no_valid_real), \
            mock.patch.object(alst, "shard_like_the_adapter", shard_with_twins), \
            mock.patch.object(TiledFusedLogitsLoss, "backward", staticmethod(loss_backward_answered)):
        yield


@contextlib.contextmanager
def deepspeed_hooks_clocked(tracker: Any) -> Iterator[None]:
    """Each call of DeepSpeed ZeRO-3's parameter coordinator (a module's hook fetching its parameters before the
    module runs, forward or backward, or releasing them after), told to the measured step's clock
    (`StepClock.zero3_hooks`): the clock prices their host work by the rates' ZeRO-3 hook seconds (`autosp
    calibrate` measures them per call), the gathers they start as ops. Only while a DeepSpeed engine was set up (its
    coordinator is imported), else nothing is touched."""
    import sys
    from unittest import mock

    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if coordinator is None:
        yield
        return
    cls = coordinator.PartitionedParameterCoordinator

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if tracker.clock is not None:
                tracker.clock.zero3_hooks(1)
            return original(self, *args, **kwargs)
        return call

    with mock.patch.object(cls, "fetch_sub_module", counted(cls.fetch_sub_module)), \
            mock.patch.object(cls, "release_sub_module", counted(cls.release_sub_module)):
        yield


@contextlib.contextmanager
def deepspeed_optimizer_offload(tracker: Any, device: DeviceModel) -> Iterator[None]:
    """DeepSpeed ZeRO-3's `offload_optimizer: cpu` (alst's GPU recipe) with its host memory booked as host.

    The fake ranks run on CPU, where DeepSpeed's "device" and its offload target are both `cpu`; on a GPU they
    differ, and what the offload config places on the host is, in DeepSpeed 0.19.8's stage3.py:
    `_create_fp32_partitions` (the fp32 master partitions), `initialize_optimizer_states` (the fp32 gradient
    partition of each sub-group), the flat gradient-partition buffer of `_setup_for_real_optimizer`
    (`grad_partitions_flat_buffer`, on `self.device` = cpu; that function's reduce buckets stay on the device) and
    `_optimizer_step` (the optimizer runs on the host: its moments and temporaries; torch's AdamW stands in for
    DeepSpeed's CPU Adam, whose moments are the same two fp32 tensors). A simulated CPU device books nothing
    here: there device and host are one memory, as the CPU meter counts them."""
    import sys
    from unittest import mock

    if device.vendor == "cpu" or "baselines.alst" not in sys.modules:
        yield
        return
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # noqa: N814 - DeepSpeed's

    def on_host(name: str) -> Any:
        original = getattr(Stage3, name)

        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.offload_optimizer:
                return original(self, *args, **kwargs)
            with tracker.host_allocations():
                return original(self, *args, **kwargs)
        return run

    setup = Stage3._setup_for_real_optimizer

    def setup_then_book(self: Any) -> None:
        setup(self)
        if self.offload_optimizer:
            tracker.mark_host(self.grad_partitions_flat_buffer)

    with contextlib.ExitStack() as stack:
        for name in ("_create_fp32_partitions", "initialize_optimizer_states", "_optimizer_step"):
            stack.enter_context(mock.patch.object(Stage3, name, on_host(name)))
        stack.enter_context(mock.patch.object(Stage3, "_setup_for_real_optimizer", setup_then_book))
        yield


@contextlib.contextmanager
def host_optimizer_state(tracker: Any) -> Iterator[None]:
    """autosp's optimizer offload (`offload=optimizer`, `autosp.comm.host_optimizer`) booked as host memory: every
    storage it makes inside its `host_region` (master weights, gradient buffers, AdamW's moments and the step's
    temporaries) on any simulated device, as the CPU meter books it in a measured run (the fake ranks run on CPU,
    where its host and device tensors are alike)."""
    from unittest import mock

    from autosp.comm import host_optimizer

    with mock.patch.object(host_optimizer, "host_region", tracker.host_allocations):
        yield
