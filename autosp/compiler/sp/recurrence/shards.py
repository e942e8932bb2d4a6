"""What the state-passing rewrites (`delta_rule`, `ssd`, `selective_scan`, `lightning`) share around their own
algebra: the check that a recurrence's inputs are this rank's shards of the sequence (else a one-line refusal), the
shard's scan from a zero state, the kernels' step sizes, and the corrected output put in place of the op.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.comm.library import op
from autosp.compiler.sp.spec import ShardSpec, SPContext, canonical_spec, node_label
from autosp.errors import SequenceParallelError


def shard_spec(ctx: SPContext, node: fx.Node, dim: int, sequence: tuple, per_head: tuple, refusal: str) -> ShardSpec:
    """The spec of the recurrence `node`'s inputs along the sequence (`sequence`): each must be this rank's shard
    along `dim` in rank order, and none of `per_head` (its parameters per head or channel, None for one not given)
    sharded; else refused in one line, `refusal` saying what was expected."""
    spec = ctx.specs.get(sequence[0])
    expected = None if spec is None else canonical_spec(dim, spec.global_len, ctx.sp_rank, ctx.sp_size)
    if expected is None or any(ctx.specs.get(t) != expected for t in sequence) or \
            any(ctx.is_local(t) for t in per_head if t is not None):
        raise SequenceParallelError(f"{node_label(node)}: {refusal}; train this model without sequence parallelism")
    return spec


def zero_state_scan(ctx: SPContext, node: fx.Node, with_state: str, spec: ShardSpec) -> tuple[fx.Node, fx.Node]:
    """(output, final state) of the op `with_state` run on `node`'s arguments: this rank's shard from a zero state."""
    scan = ctx.emit(node, op(with_state).default, node.args)
    return ctx.emit(node, operator.getitem, (scan, 0), spec=spec), ctx.emit(node, operator.getitem, (scan, 1))


def step_sizes(ctx: SPContext, node: fx.Node, dt: fx.Node, bias: fx.Node | None, softplus: bool,
               channel_dim: int) -> fx.Node:
    """A Mamba kernel's step sizes in fp32, recomputed from its inputs: dt (+ bias, per channel of dt's dim
    `channel_dim`), through softplus if the kernel applies it."""
    step = ctx.emit(node, "float", (dt,))
    if bias is not None:
        bias = ctx.emit(node, "float", (bias,))
        for _ in range(ctx.current[dt].dim() - 1 - channel_dim):
            bias = ctx.emit(node, "unsqueeze", (bias, -1))
        step = ctx.emit(node, torch.add, (step, bias))
    if softplus:
        step = ctx.emit(node, F.softplus, (step,))
    return step


def replace_corrected(ctx: SPContext, node: fx.Node, out: fx.Node, correction: fx.Node, spec: ShardSpec) -> None:
    """Put `out` + `correction` (cast to `out`'s dtype: the correction is fp32) in place of the op `node`."""
    result = ctx.emit(node, torch.add, (out, ctx.emit(node, "to", (correction, ctx.current[out].dtype))), spec=spec)
    node.replace_all_uses_with(result)
    ctx.graph.erase_node(node)  # the walk is at this node: it never visits it again
