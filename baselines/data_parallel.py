"""What the data-parallel baselines (zero3, fsdp) share: this rank's rows and a loss that sums to the global one.

Every rank gets the global batch (dp_size * batch_size rows) and trains on its own rows at full length. The
single-process reference averages over *all* valid labels of the global batch, and -100 labels are spread
unevenly over rows, so a per-rank token mean would weight ranks wrongly: each rank instead computes
sum(CE) / global_valid_count (`num_items_in_batch`), and the data-parallel reducer must *sum* gradients. Where
the library only averages (DeepSpeed divides by dp_size), the backward loss is multiplied by dp_size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from autosp.harness.config import ConfigError, RunConfig

if TYPE_CHECKING:
    from autosp.harness.parallel import ParallelContext
    from autosp.models.data import Batch


def reject_sequence_parallel(cfg: RunConfig, method: str) -> None:
    """DP baselines train full-length sequences on every rank: an SP degree other than 1 is a user error."""
    if cfg.sp_size not in (None, 1):
        raise ConfigError(f"--method {method} is data parallel only; drop --sp-size {cfg.sp_size} (or use 1)")


def local_loss(model: nn.Module, batch: Batch, ctx: ParallelContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's share of the global loss, for backward; the global loss, detached and summed over dp)."""
    rows = batch.input_ids.shape[0] // ctx.dp_size
    mine = batch.rows(ctx.dp_rank * rows, (ctx.dp_rank + 1) * rows).to(ctx.device)
    global_count = batch.num_valid_labels()
    loss = model(**mine.model_kwargs(), num_items_in_batch=global_count).loss
    total = loss.detach().clone()
    if ctx.dp_group is not None:
        dist.all_reduce(total, group=ctx.dp_group)
    return loss, total
