"""`fsdp`: PyTorch FSDP2 (`fully_shard`) over the data-parallel mesh: parameters, gradients and AdamW states
sharded; every rank trains its own full-length rows (no sequence parallelism).

The wrapping (one FSDP unit per decoder layer, gradients summed) is `baselines.fsdp_sharding.shard_llama`.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from autosp.harness.config import RunConfig
from autosp.harness.strategy import Strategy, TrainStep, register
from baselines.base import compute_dtype, module_gradients
from baselines.checkpointing import apply_activation_checkpointing
from baselines.data_parallel import local_loss, reject_sequence_parallel
from baselines.fsdp_sharding import full, shard_llama

if TYPE_CHECKING:
    from autosp.harness.parallel import ParallelContext
    from autosp.models.data import Batch


class FSDPStep(TrainStep):
    implementation = "torch-fsdp2"

    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig) -> None:
        self.model, self.ctx = model, ctx
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        loss, total = local_loss(self.model, batch, self.ctx)
        loss.backward()
        return total

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def local_gradients(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        return module_gradients(self.model)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return {name: full(p.grad, p) for name, p in self.model.named_parameters()}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: full(p, p) for name, p in self.model.named_parameters()}


@register
class FSDPStrategy(Strategy):
    name = "fsdp"
    description = "PyTorch FSDP2 fully_shard (ZeRO-3 style sharding), data parallel, full-length sequences"
    zero_stages = (3,)
    options = frozenset({"ac"})

    def validate(self, cfg: RunConfig, num_heads: int, num_kv_heads: int) -> None:
        reject_sequence_parallel(cfg, self.name)
        super().validate(cfg, num_heads, num_kv_heads)

    def setup(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig) -> TrainStep:
        checkpointed = apply_activation_checkpointing(model, cfg)  # before sharding: FSDP2 wraps those layers
        shard_llama(model, ctx.mesh["dp"], self.name, compute_dtype(cfg))
        step = FSDPStep(model, ctx, cfg)
        step.implementation += checkpointed
        return step
