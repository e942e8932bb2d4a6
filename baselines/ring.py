"""`ring`: RingAttention with zigzag load balancing, causal, inputs/positions/labels sharded by hand.

Which ring runs (recorded as `implementation`, and why the fallback ran as
`extra.ring_fallback_reason`):
* `ring-flash-attn` (`zigzag_ring_flash_attn_func`) on CUDA in bf16/fp16 when the package imports — what the
  paper's baseline runs;
* `torch-ring` (`autosp.comm.ring_attention`) everywhere else: on CPU (flash-attn has no CPU path), in fp32
  (flash-attn has no fp32 kernels, and ring-flash-attn's backward casts dq through bf16), or when
  ring-flash-attn / flash-attn is not installed. Same zigzag layout and algorithm, fp32-exact.

Plain causal attention only (as ring-flash-attn's zigzag variant): packed documents and padding masks are
refused with a ConfigError. Every query and KV head stays on every rank (no head split), so any head count works.
`--zero 3`: FSDP2 `fully_shard` per decoder layer over all ranks (`baselines.fsdp_sharding`), as `ulysses --zero 3`
does.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autosp.comm.ring_attention import zigzag_positions, zigzag_ring_attention
from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.precision import precision_of
from autosp.harness.strategy import Strategy, TrainStep, register
from baselines.base import compute_dtype
from baselines.checkpointing import apply_activation_checkpointing
from baselines.sequence_parallel import SequenceParallelStep, attention_modules, require_project_llama

if TYPE_CHECKING:
    from autosp.harness.parallel import ParallelContext

FLASH_DTYPES = (torch.bfloat16, torch.float16)


def _flash_ring(group: dist.ProcessGroup) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    from ring_flash_attn import zigzag_ring_flash_attn_func

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # [B, H, S/P, D] <-> flash-attn's [B, S/P, H, D]
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        return zigzag_ring_flash_attn_func(q, k, v, causal=True, group=group).transpose(1, 2)

    return attend


def choose_ring(device: torch.device, dtype: torch.dtype, group: dist.ProcessGroup) -> tuple[str, str, Callable]:
    """(implementation name, why not ring-flash-attn or "", attention(q, k, v) on zigzag shards)."""
    why = f"{device.type} device" if device.type != "cuda" else f"{dtype} (flash-attn needs bf16/fp16)"
    if device.type == "cuda" and dtype in FLASH_DTYPES:
        try:
            return "ring-flash-attn", "", _flash_ring(group)
        except ImportError as exc:
            why = f"ring-flash-attn unavailable: {exc}"
    return "torch-ring", why, lambda q, k, v: zigzag_ring_attention(q, k, v, group)


@register
class Ring(Strategy):
    name = "ring"
    description = "RingAttention, zigzag causal (ring-flash-attn on CUDA bf16/fp16, exact PyTorch ring elsewhere)"
    sequence_parallel = True
    zero_stages = (3, 0)  # 3 by default: FSDP2 fully_shard per decoder layer over all ranks, as `ulysses`
    options = frozenset({"ac"})

    def validate(self, cfg: RunConfig, num_heads: int, num_kv_heads: int) -> None:
        super().validate(cfg, num_heads, num_kv_heads)
        require_project_llama(cfg)
        sp = cfg.sp_size or self.default_sp_size(cfg.world_size)
        if cfg.seq_len % (2 * sp):
            raise ConfigError(
                f"--method ring: zigzag sharding cuts --seq-len {cfg.seq_len} into 2 x {sp} chunks; "
                f"use a multiple of {2 * sp}"
            )
        if cfg.data.packed_documents > 1 or cfg.data.pad_fraction > 0:
            raise ConfigError(
                "--method ring runs plain causal attention (as ring-flash-attn's zigzag ring); "
                "drop --packed-documents / --pad-fraction"
            )

    def setup(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig) -> TrainStep:
        dtype = precision_of(cfg.dtype).compute  # what attention computes in (the parameters may be fp32 masters)
        implementation, fallback_reason, attend = choose_ring(ctx.device, dtype, ctx.sp_group)
        for module in attention_modules(model, self.name):
            module.attention_fn = lambda q, k, v, mask: attend(q, k, v)  # mask: None, the model builds none

        def positions(seq_len: int) -> Tensor:
            return zigzag_positions(seq_len, ctx.sp_size, ctx.sp_rank)

        def no_mask(rows: list[Tensor] | None) -> None:
            if rows is not None:
                raise ConfigError("--method ring got a batch with packed documents or padding; it is causal only")

        implementation += apply_activation_checkpointing(model, cfg)
        sharded = self.zero_stage(cfg) == 3
        if sharded:
            from baselines.fsdp_sharding import shard_over_world

            shard_over_world(model, ctx.world_mesh, self.name, compute_dtype(cfg))
        step = SequenceParallelStep(model, ctx, cfg, positions, no_mask,
                                    implementation + ("+fsdp2-zero3" if sharded else ""), sharded=sharded)
        step.extra = {"ring_fallback_reason": fallback_reason} if fallback_reason else {}
        return step
