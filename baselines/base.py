"""What the methods share beyond the interface they implement (`autosp.harness.strategy`): mixed precision for a
replicated model, and the step of a model replicated on every rank."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from autosp.comm.precision import cast_parameters
from autosp.comm.sharding import full_name
from autosp.harness.config import RunConfig
from autosp.harness.precision import precision_of
from autosp.harness.strategy import TrainStep


def module_gradients(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
    """`TrainStep.local_gradients` of a module holding its own gradients: `.grad` as it is (a sharded parameter's
    gradient is its shard), an FSDP2 DTensor's local shard; named by the model's unsharded names."""
    for name, p in model.named_parameters():
        grad = p.grad
        yield full_name(name), grad.to_local() if isinstance(grad, DTensor) else grad


def compute_dtype(cfg: RunConfig) -> torch.dtype | None:
    """The dtype a mixed-precision `--dtype` computes in over fp32 master parameters; None when not mixed."""
    precision = precision_of(cfg.dtype)
    return precision.compute if precision.mixed else None


def compute_in_precision(model: torch.nn.Module, cfg: RunConfig) -> None:
    """Mixed precision for a replicated model: it computes on compute-dtype casts of its fp32 master parameters
    (`autosp.comm.precision`), so gradients, their reduction and AdamW's moments stay fp32."""
    dtype = compute_dtype(cfg)
    if dtype is not None:
        cast_parameters(model, dtype)


class ReplicatedTrainStep(TrainStep):
    """A step whose model and AdamW state are replicated on every rank (`self.model`, `self.optimizer`):
    gradients are already full after backward, so the full values are the local ones."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def local_gradients(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        return module_gradients(self.model)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return {full_name(n): (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu().clone()
                for n, p in self.model.named_parameters()}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {full_name(n): p.detach().cpu().clone() for n, p in self.model.named_parameters()}
