"""Sequence mixing AutoSP does not shard yet, refused in one line: an op the walk cannot follow inside a model's
module-level kernel (a gated delta rule, Kimi delta attention, SSD or selective scan called with a state or packed
documents) is refused as that kernel, named, with what to do. (A scan such as `cumsum` along the sharded
sequence is refused by `routing`.)"""
from __future__ import annotations

import torch.fx as fx

from autosp.compiler.fx import global_callee
from autosp.errors import SequenceParallelError

_WHAT_TO_DO = "train this model without sequence parallelism"


def in_kernel(node: fx.Node, error: SequenceParallelError) -> SequenceParallelError:
    """`error`, said as a refusal of the module-level kernel `node` runs in (if any) that AutoSP does not shard."""
    callee, message = global_callee(node), str(error)
    if callee is None or _WHAT_TO_DO in message:
        return error
    return SequenceParallelError(f"{message} ({callee} mixes positions along the sequence and is not yet sharded by "
                                 f"AutoSP; {_WHAT_TO_DO})")
