"""Public entry points: `autosp.compile(model, ...)` and `autosp.backend(...)`."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autosp.comm.precision import cast_parameters
from autosp.comm.sharding import check_stage, full_state, resolve_stage, shard_parameters
from autosp.compiler.backend import make_backend
from autosp.compiler.tracing import tracing_config
from autosp.errors import SequenceParallelError


class SequenceParallelModule(torch.nn.Module):
    """`model` compiled by AutoSP, called exactly like `model`.

    Every rank of the SP group passes the full, unsharded batch. The loss comes back equal to the single-device
    loss on every rank, and after `loss.backward()` every `.grad` equals the single-device gradient. Other
    outputs that run along the sequence (logits, hidden states) come back as this rank's shard: positions
    [r*L, min((r+1)*L, S)) for SP rank r, L = ceil(S/P)."""

    def __init__(self, model: torch.nn.Module, compiled: Callable, sp_group: dist.ProcessGroup, backend: Callable,
                 *, reduce_group: dist.ProcessGroup | None = None, zero: int = 0):
        super().__init__()
        self.module = model
        self._compiled = compiled
        self.sp_group = sp_group
        self.reduce_group = reduce_group or sp_group
        self.zero = zero
        self._backend = backend

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        """The optimizer for this module's parameters at its ZeRO stage: at stage 1 wrapped in torch's
        ZeroRedundancyOptimizer (state sharded over the ranks sharing the parameters); at stages 2/3 the
        parameters already are this rank's shards, so a plain optimizer holds only their state."""
        if self.zero == 1 and dist.get_world_size(self.reduce_group) > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.module.parameters(), optimizer_class=optimizer_class,
                                           process_group=self.reduce_group, **kwargs)
        return optimizer_class(self.module.parameters(), **kwargs)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter's full value on CPU, keyed by the model's own (unsharded) names."""
        return full_state(self.module, gradients=False)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter's full gradient (zeros where none) on CPU, keyed like `full_parameters`."""
        return full_state(self.module, gradients=True)

    @property
    def tiling(self) -> str:
        """One line: what the compiler tiled (loss tiles) in each graph so far, and why anything was left whole."""
        from autosp.compiler.tiling import describe

        return describe(getattr(self._backend, "tiling_reports", []))

    @property
    def tiling_reports(self) -> list:
        """One `autosp.compiler.tiling.TilingReport` per compiled graph: what was tiled, in tiles of how many tokens."""
        return list(getattr(self._backend, "tiling_reports", []))

    @property
    def partition_records(self) -> list:
        """One `autosp.compiler.sac.PartitionRecord` per compiled graph: what forward saves for backward."""
        return list(getattr(self._backend, "partition_fn").records)

    @property
    def offload_reports(self) -> list:
        """One `autosp.compiler.offload.OffloadReport` per compiled graph: the layer-boundary values kept in host
        memory between forward and backward, and their bytes (empty without offload)."""
        return [p.reports[-1] for p in getattr(self._backend, "offload_partitioners", []) if p.reports]

    @property
    def gradient_buckets(self) -> list:
        """The `autosp.comm.grad_sync.Bucket`s of the last compiled graph: one gradient collective each."""
        partitioners = getattr(self._backend, "gradient_partitioners", [])
        return list(partitioners[-1].buckets) if partitioners else []

    @property
    def gather_buckets(self) -> tuple[list, list]:
        """ZeRO 2/3: the `autosp.comm.prefetch.GatherBucket`s (forward, backward) of the last compiled graph: one
        parameter all-gather each."""
        partitioners = getattr(self._backend, "gradient_partitioners", [])
        return partitioners[-1].gather_buckets if partitioners else ([], [])

    def forward(self, *args, **kwargs):
        try:
            with tracing_config():  # logging calls do not break the graph
                return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            reason = str(e).strip().splitlines()[0]
            raise SequenceParallelError(
                f"AutoSP needs the whole forward as one graph, but Dynamo broke it: {reason} "
                "(remove the data-dependent Python control flow or unsupported call it names)"
            ) from e
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if isinstance(e.inner_exception, SequenceParallelError):
                raise e.inner_exception from None
            raise


def _groups(
    model: torch.nn.Module, sp_size: int | None, process_group: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup, int]:
    """(SP group, group of all ranks sharing the parameters, data-parallel degree)."""
    if not dist.is_initialized():
        raise SequenceParallelError(
            "AutoSP needs torch.distributed initialised (e.g. torchrun, or `autosp run --world-size P`)"
        )
    world = dist.get_world_size()
    if process_group is not None:
        sp = dist.get_world_size(process_group)
        if sp_size is not None and sp_size != sp:
            raise SequenceParallelError(f"sp_size={sp_size} contradicts the process group's size {sp}")
        return process_group, dist.group.WORLD, world // sp
    sp = sp_size or world
    if sp < 1 or world % sp:
        raise SequenceParallelError(f"sp_size={sp} must divide the world size {world}")
    if sp == world:
        return dist.group.WORLD, dist.group.WORLD, 1
    device_type = next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (world // sp, sp), mesh_dim_names=("dp", "sp"))
    return mesh.get_group("sp"), dist.group.WORLD, world // sp


def compile(  # noqa: A001  (mirrors torch.compile)
    model: torch.nn.Module,
    *,
    sp_size: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    sac: str = "sac",
    backend: str = "inductor",
    zero: int | None = None,
    compute_dtype: torch.dtype | None = None,
    tiling: str = "off",
    outputs: str = "all",
    ulysses_size: int | None = None,
    offload: str = "off",
) -> SequenceParallelModule:
    """Make `model` sequence parallel (Ulysses) by compilation; the model's code stays single-device code.

    sp_size: SP degree (default: the world size); below the world size the ranks form a (dp, sp) mesh of
    consecutive-rank SP groups. process_group: an existing SP group instead. sac: activation checkpointing
    policy (off | sac | full | budget=<fraction>). backend: inductor | aot_eager | eager (after the SP pass).
    zero: ZeRO stage 0-3 of the model state over all ranks sharing it (SP x DP; `autosp.comm.sharding`); at
    stages 2/3 the model's parameters become this rank's flat shards (build the optimizer with `make_optimizer`,
    read full values with `full_parameters`/`full_gradients`). Default: 3, the longest trainable length at the
    same correctness (0 where one rank holds the model, 1 on a backend without stages 2/3's collectives:
    `sharding.resolve_stage`); the stage that runs is the module's `zero`. compute_dtype: mixed precision, the dtype the
    model computes in over the parameters' own (fp32 master) dtype, e.g. bfloat16: parameters cast before they
    are gathered (stages 2/3) or where they are used (stages 0/1, `autosp.comm.precision`), activations and
    all-to-alls in that dtype, gradients (and their reduction) and optimizer state in the master dtype;
    default: the parameters' own dtype.
    tiling: off | loss | mlp | auto, optionally :<tokens per tile> — the LM head + cross-entropy (and token-wise
    blocks such as the MLP) run over tiles of the local tokens, recomputed in backward (exact). outputs: all | loss
    — `loss` returns None for every output but the loss; a model that returns its logits can have its loss tiled
    only then. ulysses_size: Ulysses all-to-alls inside groups of this many consecutive ranks, ring attention
    across the groups (default: the largest size the heads and the node allow; the SP degree whenever the heads
    divide it). offload: off | activations — the values backward keeps at decoder-layer boundaries wait in host
    memory between forward and backward (pinned buffers and a side stream on CUDA; `autosp.compiler.offload`)."""
    if zero is not None:
        check_stage(zero)  # before anything else: a bad stage is refused even without a process group
    sp_group, reduce_group, dp_size = _groups(model, sp_size, process_group)
    zero = resolve_stage(zero, dist.get_world_size(reduce_group), dist.get_backend(reduce_group))
    if zero >= 2 and dist.get_world_size(reduce_group) > 1:
        shard_parameters(model, reduce_group, dp_size=dp_size, regather=zero == 3, compute_dtype=compute_dtype)
    elif compute_dtype is not None:
        cast_parameters(model, compute_dtype)
    sp_backend = make_backend(sp_group, reduce_group=reduce_group, dp_size=dp_size, sac=sac, inner=backend, zero=zero,
                              tiling=tiling, outputs=outputs, ulysses_size=ulysses_size, offload=offload)
    compiled = torch.compile(model, backend=sp_backend, fullgraph=True, dynamic=False)
    return SequenceParallelModule(model, compiled, sp_group, sp_backend, reduce_group=reduce_group, zero=zero)


def backend(
    *, sp_size: int | None = None, process_group: dist.ProcessGroup | None = None, sac: str = "sac",
    inner: str = "inductor", model: torch.nn.Module | None = None, tiling: str = "off", outputs: str = "all",
    ulysses_size: int | None = None, offload: str = "off",
) -> Callable:
    """A backend for `torch.compile(model, backend=autosp.backend(...), fullgraph=True)`.

    Same semantics as `autosp.compile`; pass `model` only when sp_size < world size (to place the mesh)."""
    if process_group is None and sp_size is not None and model is None and dist.is_initialized() \
            and sp_size != dist.get_world_size():
        raise SequenceParallelError("autosp.backend(sp_size < world size) needs model= to build the (dp, sp) mesh")
    sp_group, reduce_group, dp_size = _groups(model, sp_size, process_group)
    return make_backend(sp_group, reduce_group=reduce_group, dp_size=dp_size, sac=sac, inner=inner,
                        tiling=tiling, outputs=outputs, ulysses_size=ulysses_size, offload=offload)
