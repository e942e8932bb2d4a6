"""Hand-written DeepSpeed-Ulysses, the way a DeepSpeed user writes it, in two variants of one mechanism:

* `ulysses`: each layer's attention core wrapped in `deepspeed.sequence.layer.DistributedAttention`
  (all-to-all: sequence-sharded, all heads -> full sequence, heads/P; local SDPA; all-to-all back), inputs,
  positions and labels sharded by hand (`sequence_parallel`), eager;
* `ulysses-compile`: the same model under `torch.compile` (backend `--compile-backend`). With torch 2.13 and
  DeepSpeed 0.19.8 Dynamo traces DistributedAttention's all-to-all autograd.Function as an
  `autograd_function_apply` higher-order op: the whole forward is one graph, no graph breaks (the loss, taken
  outside the model, stays eager).

`ulysses --zero 3`: the same, with parameters, gradients and AdamW state sharded over all ranks by FSDP2
(`fully_shard` per decoder layer; DeepSpeed-Ulysses with ZeRO-3 is how DeepSpeed and ALST run it), so autosp at
stage 3 is compared with a baseline at stage 3.

GQA: K/V keep their head count through the all-to-all when it divides by P (contiguous head blocks keep every
query head with its KV head); otherwise K/V heads are repeated up to lcm(kv_heads, P) first, as Ulysses users do.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.strategy import Strategy, TrainStep, register
from autosp.models.llama import attention_from_mask_rows
from baselines.base import compute_dtype
from baselines.checkpointing import apply_activation_checkpointing
from baselines.deepspeed_env import import_deepspeed, require_deepspeed
from baselines.sequence_parallel import SequenceParallelStep, attention_modules, require_project_llama

if TYPE_CHECKING:
    from autosp.harness.parallel import ParallelContext


class UlyssesAttention:
    """An `attention_fn` for the project Llama: [B, H, S/P, D] in and out, DistributedAttention in between."""

    def __init__(self, group: torch.distributed.ProcessGroup, sp_size: int, num_kv_heads: int) -> None:
        from deepspeed.sequence.layer import DistributedAttention

        self.kv_repeat = math.lcm(num_kv_heads, sp_size) // num_kv_heads
        self.mask_rows: list[Tensor] | None = None
        # DeepSpeed layout [B, S, H, D]: scatter heads (2), gather sequence (1)
        self.distributed = DistributedAttention(self._local_attention, group, scatter_idx=2, gather_idx=1)

    def set_mask_rows(self, rows: list[Tensor] | None) -> None:
        self.mask_rows = rows

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        del mask  # None: the model builds none; the full sequence's mask is self.mask_rows
        if self.kv_repeat > 1:
            k, v = k.repeat_interleave(self.kv_repeat, dim=1), v.repeat_interleave(self.kv_repeat, dim=1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return self.distributed(q, k, v, 0).transpose(1, 2)

    def _local_attention(self, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
        """Full sequence, this rank's heads: [B, S, H/P, D]."""
        out = attention_from_mask_rows(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.mask_rows)
        return out.transpose(1, 2)


@register
class Ulysses(Strategy):
    name = "ulysses"
    description = "hand-written DeepSpeed-Ulysses (DistributedAttention all-to-alls, manual sharding), eager"
    sequence_parallel = True
    compiled: ClassVar[bool] = False
    zero_stages = (3, 0)  # 3 (FSDP2) by default, as autosp: like for like, and its longest trainable length
    options = frozenset({"ac"})

    def validate(self, cfg: RunConfig, num_heads: int, num_kv_heads: int) -> None:
        require_deepspeed(self.name)
        super().validate(cfg, num_heads, num_kv_heads)
        require_project_llama(cfg)
        sp = cfg.sp_size or self.default_sp_size(cfg.world_size)
        if num_heads % sp:
            raise ConfigError(
                f"--method {self.name}: {num_heads} attention heads do not split over SP degree {sp}; "
                "use an SP degree that divides the head count"
            )

    def setup(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig) -> TrainStep:
        import_deepspeed(self.name)
        modules = attention_modules(model, self.name)
        attention = UlyssesAttention(ctx.sp_group, ctx.sp_size, modules[0].num_kv_heads)
        for module in modules:
            module.attention_fn = attention
        checkpointed = apply_activation_checkpointing(model, cfg)
        sharded = self.zero_stage(cfg) == 3
        if sharded:
            from baselines.fsdp_sharding import shard_over_world

            shard_over_world(model, ctx.world_mesh, self.name, compute_dtype(cfg))
        forward = torch.compile(model, backend=cfg.compile_backend) if self.compiled else model

        def positions(seq_len: int) -> Tensor:
            local = seq_len // ctx.sp_size
            return torch.arange(ctx.sp_rank * local, (ctx.sp_rank + 1) * local)

        implementation = "deepspeed-ulysses" + checkpointed
        implementation += "+fsdp2-zero3" if sharded else ""
        if self.compiled:
            implementation += f"+compile({cfg.compile_backend})"
        return SequenceParallelStep(model, ctx, cfg, positions, attention.set_mask_rows, implementation, forward,
                                    sharded=sharded)


@register
class UlyssesCompiled(Ulysses):
    name = "ulysses-compile"
    description = "hand-written DeepSpeed-Ulysses under torch.compile (--compile-backend), all-to-alls in the graph"
    compiled = True
    zero_stages = (0,)
    options = frozenset({"compile_backend", "ac"})
