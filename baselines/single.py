"""Method `single`: plain single-process training, the reference every parallel method is checked against."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.strategy import Strategy, TrainStep, register
from baselines.base import ReplicatedTrainStep, compute_in_precision
from baselines.checkpointing import apply_activation_checkpointing

if TYPE_CHECKING:
    from autosp.harness.parallel import ParallelContext
    from autosp.models.data import Batch


class SingleTrainStep(ReplicatedTrainStep):
    implementation = "torch-eager"

    def __init__(self, model: nn.Module, device: torch.device, lr: float):
        self.model = model
        self.device = device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # torch defaults, as every method uses

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        loss = self.model(**batch.to(self.device).model_kwargs()).loss
        loss.backward()
        return loss.detach()


@register
class Single(Strategy):
    name = "single"
    description = ("one process, the whole batch and sequence: the correctness reference (world size 1); "
                   "single[ac=layer]: with per-layer activation checkpointing, as HF's gradient checkpointing")
    distributed = False
    options = frozenset({"ac"})

    def validate(self, cfg: RunConfig, num_heads: int, num_kv_heads: int) -> None:
        if cfg.world_size != 1:
            raise ConfigError(f"--method single runs on one rank; use --world-size 1 (got {cfg.world_size})")
        if cfg.sp_size not in (None, 1):
            raise ConfigError(f"--method single has no sequence parallelism; drop --sp-size {cfg.sp_size}")

    def setup(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig) -> TrainStep:
        compute_in_precision(model, cfg)
        checkpointed = apply_activation_checkpointing(model, cfg)
        step = SingleTrainStep(model, ctx.device, cfg.lr)
        step.implementation += checkpointed
        return step
