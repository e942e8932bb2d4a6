"""`fsdp`: PyTorch FSDP2 (`fully_shard`) over the data-parallel mesh: parameters, gradients and AdamW states
sharded; every rank trains its own full-length rows (no sequence parallelism).

Each decoder layer is its own FSDP unit (all-gathered just before use, resharded after forward), the root holds
the embeddings, final norm and LM head — the wrapping FSDP users apply to Llama. Gradients are reduce-scattered
as a *sum* (divide factor 1, ReduceOp.SUM): each rank's loss is already its share of the global token mean.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from autosp.harness.config import ConfigError, RunConfig
from baselines.base import Strategy, TrainStep, register
from baselines.data_parallel import local_loss, reject_sequence_parallel

if TYPE_CHECKING:
    from autosp.models.data import Batch
    from autosp.harness.parallel import ParallelContext


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


class FSDPStep(TrainStep):
    implementation = "torch-fsdp2"

    def __init__(self, model: nn.Module, ctx: "ParallelContext", cfg: RunConfig) -> None:
        self.model, self.ctx = model, ctx
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def forward_backward(self, batch: "Batch") -> torch.Tensor:
        loss, total = local_loss(self.model, batch, self.ctx)
        loss.backward()
        return total

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return {name: _full(p.grad) for name, p in self.model.named_parameters()}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: _full(p) for name, p in self.model.named_parameters()}


@register
class FSDPStrategy(Strategy):
    name = "fsdp"
    description = "PyTorch FSDP2 fully_shard (ZeRO-3 style sharding), data parallel, full-length sequences"
    zero_stages = (3,)

    def validate(self, cfg: RunConfig, num_heads: int, num_kv_heads: int) -> None:
        reject_sequence_parallel(cfg, self.name)
        super().validate(cfg, num_heads, num_kv_heads)

    def setup(self, model: nn.Module, ctx: "ParallelContext", cfg: RunConfig) -> TrainStep:
        mesh = ctx.mesh["dp"]
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ConfigError(f"--method fsdp expects a Llama with model.layers; got {type(model).__name__}")
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        return FSDPStep(model, ctx, cfg)
