"""Mixed precision for replicated parameters (ZeRO stages 0/1): fp32 masters, the model computes on casts of them.

Every floating-point parameter gets a `torch.nn.utils.parametrize` parametrization `master.to(compute_dtype)`,
so the model's own code sees bf16 weights and runs exactly as if it had been built in bf16 (bf16 activations,
bf16 all-to-alls; where the code upcasts, e.g. RMSNorm and the loss, it upcasts as it would there), while the
parameters the optimizer steps stay fp32. The cast's backward is the upcast, so every `.grad` is fp32 and the
gradient reduction (`grad_sync`'s hooks, on the fp32 master) runs in fp32. Dynamo traces the parametrization as
model code: the casts are ordinary nodes of the one graph the SP pass rewrites, and the partitioner may recompute
them in backward rather than keep the bf16 copies. This is the semantics of FSDP2's
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` and of the sharded stages' gather
(`autosp_sp::all_gather_shard`, which casts before communicating), without sharding.

Tied parameters stay tied: a parametrization without `right_inverse` keeps the very Parameter object as its
`original`, so both modules' casts read one master and accumulate into one gradient.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize


class ComputeCast(nn.Module):
    """Parametrization: the fp32 master in, its compute-dtype copy out."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, master: torch.Tensor) -> torch.Tensor:
        return master.to(self.dtype)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> int:
    """Let `model` compute on `dtype` copies of its floating-point parameters; returns how many were cast.
    Read values under the model's own names with `autosp.comm.sharding.full_name`."""
    targets = [(module, name) for module in model.modules()
               for name, p in module.named_parameters(recurse=False) if p.is_floating_point() and p.dtype != dtype]
    for module, name in targets:
        parametrize.register_parametrization(module, name, ComputeCast(dtype), unsafe=True)
    return len(targets)
