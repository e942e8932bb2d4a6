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

Names: `named_parameters()` yields the shards (`...parametrizations.weight.original`), but `state_dict()` and
`load_state_dict()` speak the model's own names and full tensors (hooks; both collective, as FSDP's full state
dict): a checkpoint of a sharded model loads into the unsharded model, or at any other world size, and back.
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from autosp.comm.host_params import fetch_parameter
from autosp.comm.ops import all_gather_shard
from autosp.errors import SequenceParallelError

ZERO_STAGES = (0, 1, 2, 3)
#: The stage `autosp.compile` runs unless told: 3 gives the longest trainable length at the same correctness (every
#: stage passes `autosp check` alike; README "Model state at scale" has the measured searches and peaks).
DEFAULT_STAGE = 3
#: Backends without the collectives stages 2/3 put into the graph: torch's ProcessGroupMPI and ProcessGroupUCC
#: implement no `allgather_into_tensor_coalesced` (a layer's gather bucket, `autosp.compiler.zero.prefetch`).
NO_COALESCED_GATHER = ("mpi", "ucc")
#: gloo has the coalesced gather for CPU tensors only: given CUDA tensors it copies from their device pointers as if
#: they were host memory and the rank dies with SIGSEGV (pytorch/pytorch#152645, `AsyncAllgatherCoalescedWork`; the
#: crash of ZeRO 3 with AUTOSP_SHARE_GPUS=1). Its broadcast and all-reduce stage CUDA tensors through host memory.
GLOO_ON_CUDA = "gloo on CUDA tensors"
_PARAMETRIZED = re.compile(r"\.?parametrizations\.([^.]+)\.original$")


def check_stage(zero: int) -> int:
    if zero not in ZERO_STAGES:
        raise SequenceParallelError(f"zero={zero!r}: choose a ZeRO stage in {list(ZERO_STAGES)}")
    return zero


def _serving(backend: str, device_type: str) -> str:
    """The backend of a `dist.get_backend` string that serves `device_type` tensors ("cpu:gloo,cuda:nccl")."""
    for part in backend.split(","):
        device, _, name = part.rpartition(":")
        if device in ("", device_type):
            return name
    return backend


def resolve_stage(zero: int | None, group_size: int, backend: str, device_type: str = "cpu") -> int:
    """The stage to run over a group of `group_size` ranks sharing the model state (on `device_type`) on `backend`
    (a `dist.get_backend` string such as "gloo" or "cpu:gloo,cuda:nccl"): `zero`, or `DEFAULT_STAGE` when None.

    One rank shares nothing, so every stage is stage 0 there. The default falls back to stage 1 (AdamW state
    sharded by `ZeroRedundancyOptimizer`, plain broadcasts) on a backend that cannot run stages 2/3 (MPI, UCC, gloo
    on CUDA tensors); asking for 2 or 3 there is refused in one line."""
    if zero is not None:
        check_stage(zero)
    if group_size <= 1:
        return 0
    lacking = sorted({b.rpartition(":")[2] for b in backend.split(",")} & set(NO_COALESCED_GATHER))
    if device_type == "cuda" and _serving(backend, device_type) == "gloo":
        lacking.append(GLOO_ON_CUDA)
    if lacking and zero is None:
        return 1
    if lacking and zero >= 2 and lacking[0] == GLOO_ON_CUDA:
        raise SequenceParallelError(f"zero={zero} gathers parameters with all_gather_into_tensor_coalesced, which gloo "
                                    "runs on CPU tensors only (on CUDA tensors the rank dies with SIGSEGV, "
                                    "pytorch/pytorch#152645): use nccl with one GPU per rank, or zero=0/1")
    if lacking and zero >= 2:
        raise SequenceParallelError(f"zero={zero} gathers parameters with all_gather_into_tensor_coalesced, which the "
                                    f"{lacking[0]} backend lacks: use gloo or nccl, or zero=0/1")
    return DEFAULT_STAGE if zero is None else zero


class ShardedParameter(nn.Module):
    """Parametrization: a flat 1/P shard (padded to a multiple of P) in, the full parameter out. With `fetch_to`
    (offload=params, `autosp.comm.host_params`) the shard lives in host memory and is first fetched to that device;
    a group of one rank then gathers nothing (the fetch is the whole "gather")."""

    def __init__(self, shape: torch.Size, group: dist.ProcessGroup, *, dp_size: int, regather: bool,
                 compute_dtype: torch.dtype, fetch_to: torch.device | None = None) -> None:
        super().__init__()
        self.shape, self.numel = tuple(shape), math.prod(shape)
        self.group_size, self.rank, self.group_name = dist.get_world_size(group), dist.get_rank(group), group.group_name
        self.shard_numel = -(-self.numel // self.group_size)
        self.dp_size, self.regather, self.compute_dtype = dp_size, regather, compute_dtype
        self.fetch_to = fetch_to

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        if self.fetch_to is not None:
            shard = fetch_parameter(shard, self.fetch_to)
        if self.group_size == 1:
            return shard.to(self.compute_dtype).view(self.shape)
        flat = all_gather_shard(shard, self.group_size, self.group_name, self.dp_size, self.regather,
                                self.compute_dtype)
        return flat[: self.numel].view(self.shape)

    def right_inverse(self, full: torch.Tensor) -> torch.Tensor:
        padded = F.pad(full.detach().reshape(-1), (0, self.shard_numel * self.group_size - self.numel))
        return padded[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel].clone()

    def unshard(self, shard: torch.Tensor) -> torch.Tensor:
        """Collective, outside autograd: the full value of `shard` (a parameter shard or its gradient), its dtype
        (on the fetch device where the shard lives in host memory)."""
        shard = shard.detach() if self.fetch_to is None else shard.detach().to(self.fetch_to)
        if self.group_size == 1:
            return shard.reshape(self.shape)
        out = shard.new_empty(self.shard_numel * self.group_size)
        dist.all_gather_single(out, shard.contiguous(), group=dist.distributed_c10d
                                    ._resolve_process_group(self.group_name))
        return out[: self.numel].view(self.shape)


def shard_parameters(model: nn.Module, group: dist.ProcessGroup, *, dp_size: int, regather: bool,
                     compute_dtype: torch.dtype | None = None, fetch: bool = False) -> int:
    """Replace every parameter of `model` by its flat shard over `group` (stages 2 and 3); returns how many.

    A tied parameter (an LM head sharing the embedding) becomes one shard that every module using it gathers.

    `compute_dtype` (default: each parameter's own dtype): the dtype the gathered parameter is computed and
    communicated in; the shard (master weight), its gradient and the optimizer state keep the parameter's dtype.

    `fetch` (offload=params): every use first fetches the shard from host memory to the parameter's current device
    (move the shards there afterwards, `autosp.comm.host_params.place_on_host`); a group of one rank is allowed."""
    device = next(model.parameters()).device  # where a fetched shard goes (the model's device)
    owners: dict[int, tuple[nn.Module, str]] = {}
    targets, ties = [], []  # (module, name, shape, dtype); ties: (..., the module and name that own the shard)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in owners:
                ties.append((module, name, p.shape, p.dtype, *owners[id(p)]))
            else:
                targets.append((module, name, p.shape, p.dtype))
                owners[id(p)] = (module, name)
    for module, name, shape, dtype, *owner in targets + ties:
        if owner:  # registering reshards its parameter in place, and the owner's already is a shard: a stand-in
            module._parameters[name] = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
        spec = ShardedParameter(shape, group, dp_size=dp_size, regather=regather, compute_dtype=compute_dtype or dtype,
                                fetch_to=device if fetch else None)
        parametrize.register_parametrization(module, name, spec, unsafe=True)  # unsafe: shard and full differ
        if owner:  # a tied weight: one shard, gathered at each use, the gradients of the uses summed
            owner_module, owner_name = owner
            module.parametrizations[name].original = owner_module.parametrizations[owner_name].original
    for module in {id(m): m for m, *_ in targets + ties}.values():
        module.register_state_dict_post_hook(_full_state_dict)
        module.register_load_state_dict_pre_hook(_shard_state_dict)
    return len(targets)


def _sharded(module: nn.Module) -> dict[str, ShardedParameter]:
    return {name: plist[0] for name, plist in module.parametrizations.items()
            if isinstance(plist[0], ShardedParameter)}


def _full_state_dict(module: nn.Module, state_dict: dict, prefix: str, _metadata: object) -> None:
    """state_dict() post-hook (collective): each shard -> the full tensor under the parameter's own name."""
    for name, spec in _sharded(module).items():
        shard = state_dict.pop(f"{prefix}parametrizations.{name}.original")
        state_dict[prefix + name] = spec.unshard(shard)


def _shard_state_dict(module: nn.Module, state_dict: dict, prefix: str, *_args: object) -> None:
    """load_state_dict() pre-hook: a full tensor under the parameter's own name -> this rank's shard."""
    for name, spec in _sharded(module).items():
        full = state_dict.pop(prefix + name, None)
        if full is None:
            continue  # absent (load_state_dict reports it) or already a shard under the sharded name
        if tuple(full.shape) != spec.shape:
            raise SequenceParallelError(f"load_state_dict: {prefix + name} has shape {tuple(full.shape)}, the "
                                        f"model's parameter {spec.shape}; load a checkpoint of this model")
        state_dict[f"{prefix}parametrizations.{name}.original"] = spec.right_inverse(full)


def full_name(name: str) -> str:
    """`layers.0.mlp.up.parametrizations.weight.original` -> `layers.0.mlp.up.weight`."""
    return _PARAMETRIZED.sub(lambda m: "." + m.group(1), name).lstrip(".")


def full_state(model: nn.Module, *, gradients: bool, masters: Any = None) -> dict[str, torch.Tensor]:
    """Collective: every parameter's full value (or gradient; zeros where none) on CPU, keyed by the model's
    unsharded names, whatever the stage (sharded parameters are gathered, replicated ones copied). `masters`
    (`autosp.comm.host_optimizer.HostMasters`): values are read from a parameter's host master where it has one."""
    specs = {f"{prefix}.parametrizations.{name}.original".lstrip("."): plist[0]
             for prefix, module in model.named_modules() if parametrize.is_parametrized(module)
             for name, plist in module.parametrizations.items()}
    out = {}
    for name, p in model.named_parameters():
        value = (p.grad if p.grad is not None else torch.zeros_like(p)) if gradients else p
        master = masters.get(p) if masters is not None and not gradients else None
        if master is not None:
            value = master.to(p.device)
        spec = specs.get(name)
        full = spec.unshard(value) if isinstance(spec, ShardedParameter) else value.detach()
        out[full_name(name)] = full.cpu().clone()
    return out
