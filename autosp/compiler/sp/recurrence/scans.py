"""Sequence mixing AutoSP does not shard yet, refused in one line: a scan along the sharded sequence (`cumsum`,
`cumprod`, ...: each position depends on every one before it, across shards), and any op the walk cannot follow
inside a model's module-level kernel (Mamba's selective scan, the SSD chunk scan, a gated delta rule called with a
state or packed documents): the kernel is named, and what to do said."""
from __future__ import annotations

import torch
import torch.fx as fx

from autosp.compiler.fx import global_callee
from autosp.compiler.sp.spec import ShardSpec, SPContext, node_label
from autosp.errors import SequenceParallelError

_SCANS = {torch.cumsum, torch.cumprod, torch.logcumsumexp, torch.cummax, torch.cummin,
          "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "cumsum_", "cumprod_"}
_WHAT_TO_DO = "train this model without sequence parallelism"


def refuse_sequence_scan(ctx: SPContext, node: fx.Node) -> None:
    """Refuse a cumulative op along the sharded sequence dim of a local value."""
    if node.target not in _SCANS or not ctx.is_local(node.args[0]):
        return
    spec = ctx.specs[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(spec, ShardSpec) and isinstance(dim, int) and dim % ctx.current[node.args[0]].dim() == spec.dim:
        raise SequenceParallelError(
            f"{node_label(node)} scans along the sharded sequence ({getattr(node.target, '__name__', node.target)}: "
            f"a recurrence through every position) and is not yet sharded by AutoSP; {_WHAT_TO_DO}")


def in_kernel(node: fx.Node, error: SequenceParallelError) -> SequenceParallelError:
    """`error`, said as a refusal of the module-level kernel `node` runs in (if any) that AutoSP does not shard."""
    callee, message = global_callee(node), str(error)
    if callee is None or _WHAT_TO_DO in message:
        return error
    return SequenceParallelError(f"{message} ({callee} mixes positions along the sequence and is not yet sharded by "
                                 f"AutoSP; {_WHAT_TO_DO})")
