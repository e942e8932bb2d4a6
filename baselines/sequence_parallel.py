"""What the hand-written sequence-parallel baselines (ulysses*, ring) share: the training step a user writes
around a model whose attention they replaced.

Per step, on the global batch (dp_size * batch_size rows, full sequence):
* take this rank's rows (dp) and its sequence positions (sp: contiguous for Ulysses, zigzag for the ring);
* shift the labels on the *full* sequence first (a shard's last token predicts the next shard's first), then
  shard input_ids, position_ids (global positions, so RoPE is right) and the shifted labels the same way;
* run the model without labels and take the loss outside it: sum of CE over this shard / the global count of
  valid labels, so the shares of all ranks sum to the single-process token mean however unevenly -100 falls;
* after backward, all-reduce (sum) the gradients over all ranks (bucketed, like DDP / a ZeRO-0 engine); or, at
  ZeRO stage 3 (`sharded`), let FSDP2 (`baselines.fsdp_sharding`) gather parameters and reduce-scatter gradients.

The model's attention core is swapped through `LlamaAttention.attention_fn` (the project Llama's hook). The
model builds no mask of its own (`LlamaModel.builds_mask` off: one from the shard's positions would be
meaningless); the SP attention takes the full sequence's mask as its O(S) rows (`SequenceShard.mask_rows`,
run by `autosp::masked_attention`) where the data needs one, so no [S, S] mask exists on any rank.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from autosp.comm.sharding import full_name
from autosp.harness.config import ConfigError, RunConfig
from autosp.models.llama import IGNORE_INDEX, LlamaAttention, LlamaModel, attention_mask_rows
from autosp.models.presets import is_hf_name
from baselines.base import ReplicatedTrainStep, compute_in_precision
from baselines.fsdp_sharding import full

if TYPE_CHECKING:
    from autosp.harness.parallel import ParallelContext
    from autosp.models.data import Batch

#: gradient all-reduce bucket, in elements (DDP's default bucket is 25 MB)
BUCKET_ELEMENTS = 8 * 1024 * 1024


@dataclass
class SequenceShard:
    """This rank's part of the current global batch."""

    input_ids: Tensor  # [b, S/P]
    position_ids: Tensor  # [b, S/P] global positions (RoPE)
    shift_labels: Tensor  # [b, S/P] labels shifted on the full sequence, then sharded
    mask_rows: list[Tensor] | None  # the full rows' causal & document & padding mask as O(S) rows, if needed
    num_items: int  # valid labels in the whole global batch


def shard_batch(batch: Batch, ctx: ParallelContext, positions: Tensor) -> SequenceShard:
    """Rows of this dp rank; the sequence positions `positions` of those rows (shifted labels first)."""
    rows = batch.input_ids.shape[0] // ctx.dp_size
    mine = batch.rows(ctx.dp_rank * rows, (ctx.dp_rank + 1) * rows).to(ctx.device)
    seq_len = mine.input_ids.shape[1]
    full_positions = mine.position_ids
    needs_mask = full_positions is not None or mine.attention_mask is not None
    if full_positions is None:
        full_positions = torch.arange(seq_len, device=ctx.device).expand(rows, -1)
    shift_labels = F.pad(mine.labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    positions = positions.to(ctx.device)
    return SequenceShard(
        input_ids=mine.input_ids[:, positions],
        position_ids=full_positions[:, positions],
        shift_labels=shift_labels[:, positions],
        mask_rows=attention_mask_rows(full_positions, mine.attention_mask) if needs_mask else None,
        num_items=batch.num_valid_labels(),
    )


def require_project_llama(cfg: RunConfig) -> None:
    """The hand-written SP baselines hook the project Llama's attention core; HF models have no such hook here."""
    if is_hf_name(cfg.model):
        raise ConfigError(
            f"--method {cfg.method} swaps the project Llama's attention core; use a project preset "
            f"(e.g. --model {cfg.model.split(':', 1)[1]}), not {cfg.model}"
        )


def attention_modules(model: nn.Module, method: str) -> list[LlamaAttention]:
    modules = [m for m in model.modules() if isinstance(m, LlamaAttention)]
    if not modules:
        raise ConfigError(
            f"--method {method} swaps the project Llama's attention core and found none in "
            f"{type(model).__name__}; use a project preset (e.g. --model tiny), not hf:<preset>"
        )
    return modules


def all_reduce_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum every gradient over `group`, in flat buckets of at most BUCKET_ELEMENTS."""
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[Tensor] = []
    size = 0
    for i, grad in enumerate(grads):
        bucket.append(grad)
        size += grad.numel()
        if size >= BUCKET_ELEMENTS or i == len(grads) - 1:
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=group)
            for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                g.copy_(reduced)
            bucket, size = [], 0


class SequenceParallelStep(ReplicatedTrainStep):
    """A training step around a model whose attention core was replaced by a sequence-parallel one.

    `positions(seq_len)` gives the global sequence positions this rank holds; `set_mask_rows` is told the rows of
    the current batch's full mask before each forward (None for plain causal data).
    """

    def __init__(
        self,
        model: nn.Module,
        ctx: ParallelContext,
        cfg: RunConfig,
        positions: Callable[[int], Tensor],
        set_mask_rows: Callable[[list[Tensor] | None], None],
        implementation: str,
        forward: Callable[..., object] | None = None,
        sharded: bool = False,
    ) -> None:
        self.model, self.ctx = model, ctx
        self.forward = model if forward is None else forward
        self.positions, self.set_mask_rows = positions, set_mask_rows
        for module in model.modules():
            if isinstance(module, LlamaModel):
                module.builds_mask = False
        self.implementation = implementation
        self.sharded = sharded  # parameters are FSDP2 DTensors: FSDP reduces the gradients (and casts, if mixed)
        if not sharded:
            compute_in_precision(model, cfg)
        self.extra: dict[str, object] = {}  # method-specific facts for the record (`metrics`)
        self.params = list(model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr)

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        shard = shard_batch(batch, self.ctx, self.positions(batch.input_ids.shape[1]))
        self.set_mask_rows(shard.mask_rows)
        logits = self.forward(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), shard.shift_labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        ) / shard.num_items
        loss.backward()
        if not self.sharded:
            all_reduce_gradients(self.params, dist.group.WORLD)  # every rank's share of the one global loss
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return {full_name(name): full(p.grad, p) for name, p in self.model.named_parameters()}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {full_name(name): full(p, p) for name, p in self.model.named_parameters()}

    def metrics(self) -> dict[str, object]:
        return dict(self.extra)
