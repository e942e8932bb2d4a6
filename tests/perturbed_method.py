"""Test double for the correctness check: `single` with one gradient nudged by 1e-3 of its norm.

Imported into ranks with `extra_imports` / `--import tests.perturbed_method` (registers on import)."""
import torch

from autosp.harness.config import RunConfig
from autosp.harness.strategy import TrainStep, register
from baselines.single import Single, SingleTrainStep

PERTURBED = "model.layers.1.mlp.up_proj.weight"
RELATIVE_SIZE = 1e-3


class PerturbedStep(SingleTrainStep):
    def forward_backward(self, batch) -> torch.Tensor:
        loss = super().forward_backward(batch)
        grad = dict(self.model.named_parameters())[PERTURBED].grad
        grad.view(-1)[0] += RELATIVE_SIZE * grad.norm()
        return loss


@register
class SinglePerturbed(Single):
    name = "single-perturbed"
    description = "test double: single with one gradient perturbed"

    def setup(self, model, ctx, cfg: RunConfig) -> TrainStep:
        return PerturbedStep(model, ctx.device, cfg.lr)
