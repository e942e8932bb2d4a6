"""Method `autosp`: the model's ordinary single-device code, made sequence parallel by the AutoSP compiler.

Nothing here touches the model: every SP rank hands `autosp.compile`'s module the full rows of its data-parallel
replica and gets the exact global loss back. With several data-parallel replicas (sp_size < world_size) the loss
is normalised by the valid-label count of the whole global batch (`num_items_in_batch`, as HF trainers do) and
scaled by dp_size for backward, because AutoSP averages gradients over replicas.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

import autosp
from autosp.api import state_offload
from autosp.comm.host_optimizer import iter_pairs
from autosp.comm.host_pool import pool_stats
from autosp.compiler.memory import (
    OffloadPlan,
    Policy,
    SacPolicy,
    check_params_offload,
    compiled_breakdown,
    parse_policy,
    peak_working_set,
    quadratic_saved_values,
    tiles_of,
)
from autosp.compiler.options import CompileOptions
from autosp.errors import SequenceParallelError
from autosp.experiments.floor import floor_for
from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.launch import current_device
from autosp.harness.measure import ranks_on_this_node
from autosp.harness.strategy import Strategy, TrainStep, register
from baselines.base import ReplicatedTrainStep, compute_dtype

if TYPE_CHECKING:
    from autosp.harness.parallel import ParallelContext
    from autosp.models.data import Batch


class AutoSPTrainStep(ReplicatedTrainStep):
    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig, zero: int = 0):
        self.model = model
        self.ctx = ctx
        options = run_options(cfg, zero, model)
        self.compiled = autosp.compile(model, process_group=ctx.sp_group, options=options)
        self.optimizer = self.compiled.make_optimizer(torch.optim.AdamW, lr=cfg.lr)
        tiling = options.tiling_options
        offloads = options.offload_plan.items
        self.implementation = (f"autosp-{cfg.compile_backend}-sac:{cfg.sac}-zero{zero}"
                               + (f"-tiling:{cfg.tiling}" if tiling.enabled or tiling.planned else "")
                               + (f"-offload:{','.join(offloads)}" if offloads else "")
                               + (f"-chunks:{cfg.attention_chunks}" if cfg.attention_chunks > 1 else ""))
        self.seq_len = cfg.seq_len

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self.compiled.full_gradients()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.compiled.full_parameters()

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        ctx = self.ctx
        rows = batch.input_ids.shape[0] // ctx.dp_size
        mine = batch.rows(ctx.dp_rank * rows, (ctx.dp_rank + 1) * rows).to(ctx.device)
        kwargs = mine.model_kwargs()
        if ctx.dp_size > 1:
            kwargs["num_items_in_batch"] = torch.tensor(batch.num_valid_labels(), device=ctx.device)
        loss = self.compiled(**kwargs).loss
        (loss * ctx.dp_size if ctx.dp_size > 1 else loss).backward()
        total = loss.detach().clone()
        if ctx.dp_size > 1:
            dist.all_reduce(total, group=ctx.dp_group)
        return total

    def metrics(self) -> dict[str, Any]:
        """Bytes each compiled graph saves for backward, total and by operator category (the SAC comparison)."""
        host = list(iter_pairs(self.optimizer))
        optimizer = {"optimizer_offload": {
            "host_bytes": sum(o.host_bytes() for o in host), "device_bytes_saved": sum(o.device_bytes_saved()
                                                                                      for o in host),
            "implementation": host[0].implementation}} if host else {}
        records = self.compiled.partition_records
        if not records:
            return optimizer
        plans = [r.plan for r in records if r.plan is not None]
        offloads = self.compiled.offload_reports
        pool = pool_stats()  # the pinned host buffers (CUDA/ROCm; none on CPU)
        return {"saved_activation_bytes": sum(r.saved_activation_bytes for r in records),
                "saved_by_category": compiled_breakdown(records), "tiling": self.compiled.tiling,
                "saved_quadratic": quadratic_saved_values(records, self.seq_len),
                "peak_working_set": peak_working_set(records), "tiles": tiles_of(self.compiled.tiling_reports),
                **({"sac_auto": plans} if plans else {}), **optimizer,
                **({"offloaded_bytes": sum(r.nbytes for r in offloads),
                    "offloaded_values": sum(len(r.values) for r in offloads),
                    **({"host_pool": pool} if pool else {})} if offloads else {})}


def compile_options(cfg: RunConfig, zero: int) -> CompileOptions:
    """The compiler's options of run `cfg` at ZeRO stage `zero`, as written (the policy and the offload plan not
    yet resolved against the budgets: `run_options`). The step reads only the loss, so the logits need not be
    returned (nor exist whole) wherever a graph may be tiled."""
    from autosp.compiler.tiling import parse_tiling

    tiling = parse_tiling(cfg.tiling)
    return CompileOptions(sac=cfg.sac, backend=cfg.compile_backend, zero=zero, tiling=tiling,
                          outputs="loss" if tiling.enabled or tiling.planned else "all",
                          ulysses_size=cfg.ulysses_size, compute_dtype=compute_dtype(cfg), offload=cfg.offload,
                          host_budget=cfg.host_memory_budget, attention_chunks=cfg.attention_chunks)


def run_options(cfg: RunConfig, zero: int, model: nn.Module) -> CompileOptions:
    """`compile_options` with the budgets applied: the optimizer's and the parameters' `offload` decided against
    `--memory-budget` (`autosp.api.state_offload`, as `autosp.compile` decides it against the device's free
    memory), the planner's graph budget (`sac_policy`) and the host budget per rank."""
    options = compile_options(cfg, zero)
    plan = state_offload(options, model, zero=zero, group_size=cfg.world_size, device_bytes=cfg.memory_budget)
    return CompileOptions.of(options, offload=plan, sac=sac_policy(cfg, zero, plan),
                             host_budget=_host_budget_per_rank(cfg))


def sac_policy(cfg: RunConfig, zero: int, plan: OffloadPlan | None = None) -> Policy:
    """`--sac auto` with `--memory-budget`: the graph's byte budget is the run's budget less what the memory
    meter finds resident when the step starts: parameters, AdamW moments (none on the device with the optimizer
    state in host memory: `plan`, default `--offload` as written), gathered parameters (the floor's arithmetic) and
    the global batch every rank holds. The gradients are made in backward and the planner counts them itself."""
    from autosp.harness.runner import global_batch

    policy = parse_policy(cfg.sac)
    if policy.kind != SacPolicy.AUTO or policy.budget_bytes is not None or cfg.memory_budget is None:
        return policy
    plan = plan or OffloadPlan.parse(cfg.offload)
    state = floor_for("autosp", cfg.model, world_size=cfg.world_size, batch_size=cfg.batch_size, dtype=cfg.dtype,
                      zero=zero, optimizer_offload=plan.optimizer == "on", params_offload=plan.params == "on")
    batch = global_batch(cfg, cfg.sp_size or cfg.world_size).model_kwargs().values()
    resident = (state.params_bytes + state.optimizer_bytes + state.gathered_unit_bytes
                + sum(t.numel() * t.element_size() for t in batch))
    return Policy(SacPolicy.AUTO, budget_bytes=max(0, cfg.memory_budget - resident))


@register
class AutoSP(Strategy):
    name = "autosp"
    description = "AutoSP: Ulysses sequence parallelism inserted by the compiler into unmodified model code"
    sequence_parallel = True
    distributed = False  # one rank: the SP pass shards nothing; the planner, tiling and the offloads still apply
    zero_stages = (3, 0, 1, 2)  # 3 by default: the longest trainable length (README, "Model state at scale")
    pads_sequence = True
    options = frozenset({"sac", "compile_backend", "tiling", "ulysses_size", "offload", "attention_chunks"})
    #: the paper's setting (sequence-aware checkpointing, nothing tiled or offloaded): the SAC figure's and the
    #: paper-reproduction rows' autosp; the default is the planner's (sac, tiling and offload all decided by it)
    presets = {"paper": {"sac": "sac", "tiling": "off", "offload": "off"}}

    def zero_stage(self, cfg: RunConfig) -> int:
        """One rank shares nothing: stage 0 is what runs there, whatever was asked (`resolve_stage`)."""
        return 0 if cfg.world_size == 1 else super().zero_stage(cfg)

    def validate(self, cfg: RunConfig, num_heads: int, num_kv_heads: int) -> None:
        super().validate(cfg, num_heads, num_kv_heads)
        sp = cfg.sp_size or self.default_sp_size(cfg.world_size)
        u = cfg.ulysses_size
        if u is not None and (u < 1 or sp % u or num_heads % u):  # the compiler also checks the KV heads
            valid = [d for d in range(1, sp + 1) if sp % d == 0 and num_heads % d == 0]
            raise ConfigError(f"--ulysses-size {u} must divide the SP degree {sp} and the {num_heads} query heads; "
                              f"valid: {valid}")
        per_rank = num_heads // (u or sp)
        # the compiler also checks how the chunks meet the KV heads
        if num_heads % (u or sp) == 0 and per_rank % cfg.attention_chunks:
            raise ConfigError(f"--attention-chunks {cfg.attention_chunks} must divide the {per_rank} query heads each "
                              f"rank attends ({num_heads} over {u or sp}); valid: "
                              f"{[d for d in range(1, per_rank + 1) if per_rank % d == 0]}")
        try:  # the compiler's own checks, before any rank starts: one error type for the harness
            options = compile_options(cfg, self.zero_stage(cfg))
            check_params_offload(options.offload_plan, self.zero_stage(cfg), cfg.world_size)
        except SequenceParallelError as e:
            raise ConfigError(f"--method {cfg.method}: {e}") from None

    def setup(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig) -> TrainStep:
        return AutoSPTrainStep(model, ctx, cfg, zero=self.zero_stage(cfg))


def _host_budget_per_rank(cfg: RunConfig) -> int | None:
    """The planner's share of `--host-memory-budget` (a node's): the node's budget over the ranks sharing it."""
    if cfg.host_memory_budget is None:
        return None
    return cfg.host_memory_budget // ranks_on_this_node(current_device(cfg.device))
