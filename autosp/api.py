"""Public entry points: `autosp.compile(model, ...)` and `autosp.backend(...)`."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autosp.comm.host_optimizer import HostMasters, HostOptimizer, check_host_budget
from autosp.comm.host_params import place_on_host
from autosp.comm.precision import cast_parameters
from autosp.comm.sharding import full_state, resolve_stage, shard_parameters
from autosp.compiler.backend import make_backend
from autosp.compiler.memory import OffloadPlan, SacPolicy, check_params_offload
from autosp.compiler.options import CompileOptions
from autosp.compiler.tracing import breaking_module, data_dependent_shape_error, tracing_config
from autosp.errors import SequenceParallelError


class SequenceParallelModule(torch.nn.Module):
    """`model` compiled by AutoSP, called exactly like `model`.

    Every rank of the SP group passes the full, unsharded batch. The loss comes back equal to the single-device
    loss on every rank, and after `loss.backward()` every `.grad` equals the single-device gradient. Other
    outputs that run along the sequence (logits, hidden states) come back as this rank's shard: positions
    [r*L, min((r+1)*L, S)) for SP rank r, L = ceil(S/P)."""

    def __init__(self, model: torch.nn.Module, compiled: Callable, sp_group: dist.ProcessGroup, backend: Callable,
                 *, reduce_group: dist.ProcessGroup | None = None, zero: int = 0,
                 host_masters: HostMasters | None = None, host_adam: str | None = None):
        super().__init__()
        self.module = model
        self._compiled = compiled
        self.sp_group = sp_group
        self.reduce_group = reduce_group or sp_group
        self.zero = zero
        self._backend = backend
        #: offload=optimizer: the host master of every parameter (`autosp.comm.host_optimizer`), and the host AdamW
        self.host_masters = host_masters
        self.host_adam = host_adam

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], *, overlap_step: bool = False,
                       **kwargs) -> torch.optim.Optimizer:
        """The optimizer for this module's parameters at its ZeRO stage: at stage 1 wrapped in torch's
        ZeroRedundancyOptimizer (state sharded over the ranks sharing the parameters); at stages 2/3 the
        parameters already are this rank's shards, so a plain optimizer holds only their state. With
        offload=optimizer the class steps host masters on the CPU (`autosp.comm.host_optimizer.HostOptimizer`);
        `overlap_step` lets it step each parameter during the backward run inside `optimizer.overlapping()`, as its
        gradient reaches host memory (exact: `autosp.comm.early_step`; 12 more host bytes per fp32 parameter)."""
        if overlap_step and self.host_masters is None:
            raise SequenceParallelError("make_optimizer(overlap_step=True) steps host masters during backward: compile "
                                        "with offload='optimizer' (or 'auto,optimizer'), or drop overlap_step")
        if self.host_masters is not None:
            use_deepspeed = {"auto": None, "torch": False, "deepspeed": True}[self.host_adam or "auto"]
            optimizer_class = functools.partial(HostOptimizer, optimizer_class=optimizer_class,
                                                masters=self.host_masters, use_deepspeed=use_deepspeed,
                                                overlap_step=overlap_step)
        if self.zero == 1 and dist.get_world_size(self.reduce_group) > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(self.module.parameters(), optimizer_class=optimizer_class,
                                                process_group=self.reduce_group, **kwargs)
            if self.host_masters is not None:  # the other ranks step (and hold the masters of) the rest
                self.host_masters.keep_only(p for g in optimizer.optim.param_groups for p in g["params"])
            return optimizer
        return optimizer_class(self.module.parameters(), **kwargs)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter's full value on CPU, keyed by the model's own (unsharded) names (with
        offload=optimizer the host masters', not their compute-dtype casts on the device)."""
        masters = self.host_masters
        if masters is not None and self.zero == 1 and dist.get_world_size(self.reduce_group) > 1:
            masters = self._gathered_masters()
        return full_state(self.module, gradients=False, masters=masters)

    def _gathered_masters(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Collective, ZeRO 1 with offload=optimizer: every parameter's master from the rank that steps it (a sum
        over the ranks of the owner's master and everyone else's zeros, exact)."""
        out = {}
        for p in dict.fromkeys(self.module.parameters()):
            if not p.is_floating_point():
                continue
            mine = self.host_masters.get(p)
            value = (mine.to(p.device) if mine is not None
                     else torch.zeros(p.shape, dtype=self.host_masters.master_dtype, device=p.device))
            dist.all_reduce(value, group=self.reduce_group)
            out[p] = value
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter's full gradient (zeros where none) on CPU, keyed like `full_parameters`."""
        return full_state(self.module, gradients=True)

    @property
    def _compilation(self):
        return self._backend.compilation

    @property
    def tiling(self) -> str:
        """One line: what the compiler tiled (loss tiles) in each graph so far, and why anything was left whole."""
        from autosp.compiler.tiling import describe

        return describe(self._compilation.tiling_reports)

    @property
    def tiling_reports(self) -> list:
        """One `autosp.compiler.tiling.TilingReport` per compiled graph: what was tiled, in tiles of how many tokens."""
        return list(self._compilation.tiling_reports)

    @property
    def partition_records(self) -> list:
        """One `autosp.compiler.memory.PartitionRecord` per compiled graph: what forward saves for backward."""
        return list(self._compilation.partition_fn.records)

    @property
    def offload_reports(self) -> list:
        """One `autosp.compiler.memory.offload.OffloadReport` per compiled graph: the layer-boundary values kept in host
        memory between forward and backward, and their bytes (empty without offload)."""
        return [g.offload_reports[-1] for g in self._compilation.graphs if g.offload_reports]

    @property
    def gradient_buckets(self) -> list:
        """The `autosp.compiler.zero.grad_buckets.Bucket`s of the last compiled graph: one gradient collective each."""
        graphs = self._compilation.graphs
        return list(graphs[-1].buckets) if graphs else []

    @property
    def gather_buckets(self) -> tuple[list, list]:
        """ZeRO 2/3: the `autosp.compiler.zero.prefetch.GatherBucket`s (forward, backward) of the last compiled graph:
        one parameter all-gather each."""
        graphs = self._compilation.graphs
        return graphs[-1].gather_buckets if graphs else ([], [])

    def forward(self, *args, **kwargs):
        try:
            # also entered by Dynamo around the backend's calls (`backend_ctx_ctor`), which alone did not keep a
            # model's logging call out of the graph (tests/compiler/test_coverage.py, the soft-capped attention)
            with tracing_config():
                return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            if isinstance(e.__cause__, torch._dynamo.exc.ObservedException):  # the model's own code raised
                raise SequenceParallelError(
                    f"the model's forward{breaking_module(self.module, e)} "
                    f"{' '.join(str(e.__cause__).split())[:300]} while "
                    "Dynamo traced it (it raises the same without AutoSP): fix what that error names"
                ) from e
            reason = str(e).strip().splitlines()[0]
            raise SequenceParallelError(
                f"AutoSP needs the whole forward as one graph, but Dynamo broke it{breaking_module(self.module, e)}: "
                f"{reason} "
                "(remove the data-dependent Python control flow or unsupported call it names)"
            ) from e
        except torch._dynamo.exc.UserError as e:
            raise SequenceParallelError(data_dependent_shape_error(self.module, e)) from None
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            limit = torch._dynamo.config.recompile_limit
            raise SequenceParallelError(
                f"Dynamo's recompile limit (torch._dynamo.config.recompile_limit={limit}) was hit: the model was "
                f"compiled {limit} times because its inputs' static sizes or guards kept changing; past the limit it "
                "would run unsharded on every rank, so AutoSP stops (sequence lengths recompile only once; keep "
                "other input sizes to a few values, or raise the limit)"
            ) from None
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
    options: CompileOptions | None = None,
    **keywords: Any,
) -> SequenceParallelModule:
    """Make `model` sequence parallel (Ulysses) by compilation; the model's code stays single-device code.

    sp_size: SP degree (default: the world size); below the world size the ranks form a (dp, sp) mesh of
    consecutive-rank SP groups. process_group: an existing SP group instead. The compiler's options, given as an
    `options=CompileOptions(...)` object and/or as keywords (which override it): sac, backend, zero,
    compute_dtype, tiling, outputs, ulysses_size, attention_chunks, offload (`offload="optimizer"`: master weights
    and AdamW moments in host memory, the step on the CPU), host_budget; each field's meaning, default and valid
    values are in
    `autosp.compiler.options.CompileOptions`. At ZeRO stages 2/3 the model's parameters become this rank's flat
    shards (build the optimizer with `make_optimizer`, read full values with `full_parameters`/`full_gradients`);
    the stage that runs is the module's `zero`."""
    options = CompileOptions.of(options, **keywords)  # every option checked, before anything else
    sp_group, reduce_group, dp_size = _groups(model, sp_size, process_group)
    device_type = next(model.parameters(), torch.empty(0)).device.type
    group_size = dist.get_world_size(reduce_group)
    zero = resolve_stage(options.zero, group_size, dist.get_backend(reduce_group), device_type)
    options = CompileOptions.of(options, offload=state_offload(options, model, zero=zero, group_size=group_size))
    check_params_offload(options.offload_plan, zero, group_size)
    if (zero >= 2 and group_size > 1) or options.host_params:  # params: one rank's "shard" is the whole parameter
        shard_parameters(model, reduce_group, dp_size=dp_size, regather=zero == 3,
                         compute_dtype=options.compute_dtype, fetch=options.host_params)
    elif options.compute_dtype is not None and options.host_adam is None:
        cast_parameters(model, options.compute_dtype)
    masters = None
    if options.host_adam is not None:  # the masters and moments in host memory; the device keeps compute-dtype casts
        stepped = [p for p in dict.fromkeys(model.parameters()) if p.is_floating_point()]
        numel = sum(p.numel() for p in stepped) // (group_size if zero == 1 else 1)
        master_dtype = stepped[0].dtype if stepped else torch.float32
        need = check_host_budget(numel, master_dtype, options.host_budget,
                                 params_dtype=(options.compute_dtype or master_dtype) if options.host_params else None)
        if options.host_budget is not None:  # the planner's activations get what the optimizer state leaves
            options = CompileOptions.of(options, host_budget=options.host_budget - need)
        masters = HostMasters.capture(stepped, options.compute_dtype)
        if options.host_params:  # the compute-dtype parameters (shards) too; their gradients come in backward
            place_on_host(stepped)
            masters.params_on_host = True
    sp_backend = make_backend(sp_group, options, reduce_group=reduce_group, dp_size=dp_size, zero=zero, model=model)
    # dynamic=None: a size that changes between calls (the sequence length) makes Dynamo trace once more with that
    # size symbolic; the backend then specialises the one trace per length (`specialize.per_length`)
    compiled = torch.compile(model, backend=sp_backend, fullgraph=True, dynamic=None)
    return SequenceParallelModule(model, compiled, sp_group, sp_backend, reduce_group=reduce_group, zero=zero,
                                  host_masters=masters, host_adam=options.host_adam)


def state_offload(options: CompileOptions, model: torch.nn.Module, *, zero: int, group_size: int,
                  device_bytes: int | None = None) -> OffloadPlan:
    """`options.offload_plan` with the optimizer's and the parameters' `auto` decided for `model` at this ZeRO stage
    (`OffloadPlan.resolve_state`): against `device_bytes` (this rank's device memory for the model state; None: the
    device's free memory plus the parameters already on it on CUDA, no limit on CPU); off under any policy but the
    planner's. The optimizer's bytes on the device are its masters and moments, plus, where torch steps AdamW
    multi-tensor (its default on CUDA/ROCm), the step's temporary as large as the moments of one kind (`_foreach_sqrt`
    of the second moments): Llama-3.1-8B on one h200-141gb holds 120 GiB of state and moments but peaks at 150 GiB
    in that step."""
    plan = options.offload_plan
    if "auto" not in (plan.optimizer, plan.params):
        return plan
    if options.policy.kind != SacPolicy.AUTO:
        return dataclasses.replace(plan, optimizer=plan.optimizer.replace("auto", "off"),
                                   params=plan.params.replace("auto", "off"))
    params = [p for p in dict.fromkeys(model.parameters()) if p.is_floating_point()]
    numel = sum(p.numel() for p in params)
    master = params[0].element_size() if params else 4
    compute = torch.empty((), dtype=options.compute_dtype).element_size() if options.compute_dtype else master
    stored = -(-numel // group_size) if zero >= 2 else numel  # parameters (and gradients) this rank keeps
    stepped = -(-numel // group_size) if zero >= 1 else numel  # parameters whose AdamW moments this rank keeps
    if device_bytes is None and params and params[0].device.type == "cuda":
        device_bytes = torch.cuda.mem_get_info(params[0].device)[0] + numel * master
    moments = 3 if params and _steps_multi_tensor(params) else 2  # the two moments (and the step's temporary)
    return plan.resolve_state(device_bytes=device_bytes, state_bytes=2 * stored * master,
                              optimizer_bytes=moments * stepped * master, compute_state_bytes=2 * stored * compute,
                              params_allowed=zero == 3 or group_size == 1)


def _steps_multi_tensor(params: list[torch.Tensor]) -> bool:
    """Whether torch's AdamW steps these parameters multi-tensor (foreach), as it decides by their device."""
    from torch.optim.adam import _default_to_fused_or_foreach

    return _default_to_fused_or_foreach(params, False, use_fused=False)[1]


def backend(
    *, sp_size: int | None = None, process_group: dist.ProcessGroup | None = None,
    model: torch.nn.Module | None = None, options: CompileOptions | None = None, **keywords: Any,
) -> Callable:
    """A backend for `torch.compile(model, backend=autosp.backend(...), fullgraph=True)`.

    Same options as `autosp.compile` (the parameters stay replicated: ZeRO stage 0, the model's own dtype). Pass
    `model` when sp_size < world size (to place the mesh), and for an HF model asked for router logits or hidden
    states (its output hooks must be installed before Dynamo traces). Dynamo's own errors (graph breaks, sizes
    read from tensor values) reach the caller as Dynamo raises them, and AutoSP's refusals as Dynamo's
    `BackendCompilerFailed` around the one-line `SequenceParallelError` (its `inner_exception`): only the
    `autosp.compile` wrapper sits around the call to turn them into one line."""
    options = CompileOptions.of(options, **keywords)
    if options.zero not in (None, 0) or options.compute_dtype is not None or options.host_adam is not None:
        raise SequenceParallelError("autosp.backend keeps the parameters as they are (ZeRO stage 0, their own dtype, "
                                    "the optimizer's state where the optimizer puts it); use autosp.compile for zero=, "
                                    "compute_dtype= or offload=optimizer")
    if process_group is None and sp_size is not None and model is None and dist.is_initialized() \
            and sp_size != dist.get_world_size():
        raise SequenceParallelError("autosp.backend(sp_size < world size) needs model= to build the (dp, sp) mesh")
    sp_group, reduce_group, dp_size = _groups(model, sp_size, process_group)
    return make_backend(sp_group, options, reduce_group=reduce_group, dp_size=dp_size, model=model)
