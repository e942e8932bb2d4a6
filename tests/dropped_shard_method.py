"""Test double for the correctness check at ZeRO stages 2/3: `autosp` with the last rank's reduce-scattered
gradient shard of one parameter dropped (zeroed), as a lost reduce-scatter output would leave it.

Imported into ranks with `extra_imports` / `--import tests.dropped_shard_method` (registers on import)."""
import torch
import torch.distributed as dist

from autosp.harness.config import RunConfig
from autosp.harness.strategy import TrainStep, register
from baselines.autosp_method import AutoSP, AutoSPTrainStep

DROPPED = "model.layers.1.mlp.up_proj.parametrizations.weight.original"


class DroppedShardStep(AutoSPTrainStep):
    def forward_backward(self, batch) -> torch.Tensor:
        loss = super().forward_backward(batch)
        if dist.get_rank() == dist.get_world_size() - 1:
            dict(self.model.named_parameters())[DROPPED].grad.zero_()
        return loss


@register
class AutoSPDroppedShard(AutoSP):
    name = "autosp-dropped-shard"
    description = "test double: autosp (zero 2/3) with one rank's gradient shard of one parameter dropped"
    zero_stages = (2, 3)

    def setup(self, model, ctx, cfg: RunConfig) -> TrainStep:
        return DroppedShardStep(model, ctx, cfg, zero=self.zero_stage(cfg))
