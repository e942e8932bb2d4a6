"""FSDP2 (`fully_shard`) the way FSDP users wrap a Llama, shared by `fsdp` and the ZeRO-3 variants of the
hand-written SP baselines (`ulysses --zero 3`, `ring --zero 3`), in full or mixed precision.

Each decoder layer is its own FSDP unit (all-gathered just before use, resharded after forward, gathered again for
backward), the root holds the embeddings, final norm and LM head. Gradients are reduce-scattered as a *sum*
(divide factor 1, ReduceOp.SUM; gloo has no PREMUL_SUM): each rank's loss is already its share of the global loss.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from autosp.harness.config import ConfigError


def shard_llama(model: nn.Module, mesh: DeviceMesh, method: str, compute_dtype: torch.dtype | None = None) -> None:
    """fully_shard every decoder layer, then the root, over `mesh`; gradients summed. `compute_dtype`: mixed
    precision as FSDP2 does it, `MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)`:
    parameters cast before the all-gather, gradients reduce-scattered in fp32 onto the fp32 master shards."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"--method {method} expects a Llama with model.layers; got {type(model).__name__}")
    policy = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype
              else MixedPrecisionPolicy())
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def shard_over_world(model: nn.Module, world_mesh: DeviceMesh | None, method: str,
                     compute_dtype: torch.dtype | None = None) -> None:
    """ZeRO stage 3 of a hand-written SP baseline: `shard_llama` over every rank (all SP x DP ranks share the
    parameters; `ParallelContext.world_mesh`), mixed precision by FSDP2's policy when `compute_dtype` is given."""
    if world_mesh is None:
        raise ConfigError(f"--method {method} --zero 3 needs an initialised process group")
    shard_llama(model, world_mesh, method, compute_dtype)


def full(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor: the full value on CPU (zeros for a missing gradient)."""
    if t is None:
        t = torch.zeros_like(like)
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
