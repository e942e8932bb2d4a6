"""ZeRO stages for a model compiled by AutoSP: model state sharded over every rank that holds a replica (SP x DP).

  stage 0  parameters, gradients, AdamW state replicated; gradients all-reduced (`grad_sync`)
  stage 1  + AdamW state sharded: torch's `ZeroRedundancyOptimizer` (each rank steps its share of the
           parameters and broadcasts them)
  stage 2  + gradients reduce-scattered: every parameter is stored as a flat 1/P shard; the compiled forward
           all-gathers it where the model uses it and keeps the full value for backward (FSDP's SHARD_GRAD_OP);
           the gather's gradient is a reduce-scatter inside the backward graph, so each rank receives only its
           shard's gradient; AdamW steps the shards
  stage 3  + the gathered parameter is not kept: the partitioner re-runs the gather in backward (by design: a
           deliberate re-gather, the only collective ever recomputed), so a full parameter lives only between its
           gather and its last use, in forward and again in backward

Mechanism (see DESIGN.md for why): a `torch.nn.utils.parametrize` parametrization replaces `module.weight` by
`all_gather_shard(shard)[:numel].view(shape)`. Dynamo traces the parametrization like model code, so the gathers
land in the same full graph the SP pass rewrites and SAC partitions; the model's code is untouched.
"""
from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from autosp.comm.ops import all_gather_shard
from autosp.errors import SequenceParallelError

ZERO_STAGES = (0, 1, 2, 3)
_PARAMETRIZED = re.compile(r"\.?parametrizations\.([^.]+)\.original$")


def check_stage(zero: int) -> int:
    if zero not in ZERO_STAGES:
        raise SequenceParallelError(f"zero={zero!r}: choose a ZeRO stage in {list(ZERO_STAGES)}")
    return zero


class ShardedParameter(nn.Module):
    """Parametrization: a flat 1/P shard (padded to a multiple of P) in, the full parameter out."""

    def __init__(self, shape: torch.Size, group: dist.ProcessGroup, *, dp_size: int, regather: bool,
                 compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.shape, self.numel = tuple(shape), math.prod(shape)
        self.group_size, self.rank, self.group_name = dist.get_world_size(group), dist.get_rank(group), group.group_name
        self.shard_numel = -(-self.numel // self.group_size)
        self.dp_size, self.regather, self.compute_dtype = dp_size, regather, compute_dtype

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        flat = all_gather_shard(shard, self.group_size, self.group_name, self.dp_size, self.regather,
                                self.compute_dtype)
        return flat[: self.numel].view(self.shape)

    def right_inverse(self, full: torch.Tensor) -> torch.Tensor:
        padded = F.pad(full.detach().reshape(-1), (0, self.shard_numel * self.group_size - self.numel))
        return padded[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel].clone()

    def unshard(self, shard: torch.Tensor) -> torch.Tensor:
        """Collective, outside autograd: the full value of `shard` (a parameter shard or its gradient), its dtype."""
        out = shard.new_empty(self.shard_numel * self.group_size)
        dist.all_gather_single(out, shard.detach().contiguous(), group=dist.distributed_c10d
                                    ._resolve_process_group(self.group_name))
        return out[: self.numel].view(self.shape)


def shard_parameters(model: nn.Module, group: dist.ProcessGroup, *, dp_size: int, regather: bool,
                     compute_dtype: torch.dtype | None = None) -> int:
    """Replace every parameter of `model` by its flat shard over `group` (stages 2 and 3); returns how many.

    `compute_dtype` (default: each parameter's own dtype): the dtype the gathered parameter is computed and
    communicated in; the shard (master weight), its gradient and the optimizer state keep the parameter's dtype."""
    seen: dict[int, str] = {}
    targets = []
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            qualified = f"{module_name}.{name}".lstrip(".")
            if id(p) in seen:
                raise SequenceParallelError(
                    f"zero>=2 shards each parameter once, but {qualified} is tied to {seen[id(p)]}; "
                    "untie the weights or use zero=0/1")
            seen[id(p)] = qualified
            targets.append((module, name, p))
    for module, name, p in targets:
        spec = ShardedParameter(p.shape, group, dp_size=dp_size, regather=regather,
                                compute_dtype=compute_dtype or p.dtype)
        parametrize.register_parametrization(module, name, spec, unsafe=True)  # unsafe: shard and full differ
    return len(targets)


def full_name(name: str) -> str:
    """`layers.0.mlp.up.parametrizations.weight.original` -> `layers.0.mlp.up.weight`."""
    return _PARAMETRIZED.sub(lambda m: "." + m.group(1), name).lstrip(".")


def full_state(model: nn.Module, *, gradients: bool) -> dict[str, torch.Tensor]:
    """Collective: every parameter's full value (or gradient; zeros where none) on CPU, keyed by the model's
    unsharded names, whatever the stage (sharded parameters are gathered, replicated ones copied)."""
    specs = {f"{prefix}.parametrizations.{name}.original".lstrip("."): plist[0]
             for prefix, module in model.named_modules() if parametrize.is_parametrized(module)
             for name, plist in module.parametrizations.items()}
    out = {}
    for name, p in model.named_parameters():
        value = (p.grad if p.grad is not None else torch.zeros_like(p)) if gradients else p
        spec = specs.get(name)
        full = spec.unshard(value) if isinstance(spec, ShardedParameter) else value.detach()
        out[full_name(name)] = full.cpu().clone()
    return out
