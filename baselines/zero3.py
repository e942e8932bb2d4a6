"""`zero3`: DeepSpeed ZeRO stage 3 through `deepspeed.initialize`: parameters, gradients and optimizer states
partitioned over the data-parallel ranks; every rank trains its own full-length rows (no sequence parallelism).

`stage3_param_persistence_threshold: 0` partitions every parameter, however small (DeepSpeed's default keeps
parameters under 100K elements whole on every rank, which on the small CPU presets would be nearly all of them
and turn ZeRO-3 into plain data parallelism). Its communication buckets are capped at the model's parameter
count (its preset's, so a shortened stand-in is configured as the real model): DeepSpeed allocates the whole reduce
bucket (default 5e8 elements, 1.9 GiB in fp32) up front, which on a model smaller than that is pure overhead no tuned
setup would keep. The optimizer is the same torch AdamW as the reference, handed to DeepSpeed as a client optimizer
(DeepSpeed's own FusedAdam would need a JIT build on CPU). DeepSpeed averages gradients over the dp ranks, so the
backward loss (each rank's share of the global token mean) is multiplied by dp_size to make that average a sum. On
gloo the shared-memory comm op build is skipped (`deepspeed_env`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autosp.harness.config import RunConfig
from autosp.harness.strategy import Strategy, TrainStep, register
from autosp.models.build import parameter_count
from baselines.checkpointing import apply_activation_checkpointing
from baselines.data_parallel import local_loss, reject_sequence_parallel
from baselines.deepspeed_env import DeepSpeedZeroStep, import_deepspeed, precision_config, require_deepspeed

if TYPE_CHECKING:
    from autosp.harness.parallel import ParallelContext
    from autosp.models.data import Batch


#: DeepSpeed's defaults (elements); its reduce bucket is allocated whole (5e8 fp32 = 1.9 GiB) at the first backward
DEFAULT_REDUCE_BUCKET = 500_000_000
DEFAULT_PREFETCH_BUCKET = 50_000_000


def zero3_config(cfg: RunConfig, num_params: int) -> dict[str, Any]:
    """ZeRO-3 as tuned for this model: every parameter partitioned, buckets no larger than the model."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": min(DEFAULT_REDUCE_BUCKET, num_params),
            "stage3_prefetch_bucket_size": min(DEFAULT_PREFETCH_BUCKET, num_params),
            "contiguous_gradients": True,
            "overlap_comm": cfg.device != "cpu",
        },
    }
    return {**config, **precision_config(cfg.dtype, "zero3")}


class Zero3Step(DeepSpeedZeroStep):
    implementation = "deepspeed-zero3"

    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig) -> None:
        self.deepspeed = import_deepspeed("zero3")
        self.ctx = ctx
        self.implementation += apply_activation_checkpointing(model, cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        # the preset's count, not this module's: a shorter stand-in (the simulator's 2 and 3 layers) is configured
        # as the real model, so its buckets, and the bytes they hold, are the real model's
        config = zero3_config(cfg, parameter_count(cfg.model))
        self.engine, *_ = self.deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        loss, total = local_loss(self.engine, batch, self.ctx)
        self.engine.backward(loss * self.ctx.dp_size)
        return total



@register
class Zero3Strategy(Strategy):
    name = "zero3"
    description = "DeepSpeed ZeRO stage 3 (every parameter partitioned), data parallel, full-length sequences"
    zero_stages = (3,)
    options = frozenset({"ac"})

    def validate(self, cfg: RunConfig, num_heads: int, num_kv_heads: int) -> None:
        reject_sequence_parallel(cfg, self.name)
        require_deepspeed(self.name)
        super().validate(cfg, num_heads, num_kv_heads)
        precision_config(cfg.dtype, self.name)

    def setup(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig) -> TrainStep:
        return Zero3Step(model, ctx, cfg)
