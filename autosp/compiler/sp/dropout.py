"""Dropout on the sharded sequence: each rank applies its slice of the mask single-device training draws.

A rank that drew a mask for its own shard would consume the random stream differently from single-device training
(and ranks seeded alike would drop the same positions of every shard). Instead every rank draws the mask of the
*full* activation exactly as eager `native_dropout` does on the CPU (`empty_like(x).bernoulli_(1 - p)`, the same
random numbers in the same order) and keeps its slice: `x * mask * 1/(1-p)` is then the single-device value at
this rank's positions. The mask is O(full activation) while it is drawn, then only the slice lives on; the random
stream matches under eager / aot_eager lowering (inductor draws its own random numbers unless
`torch._inductor.config.fallback_random` is set).
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.compiler.sp.spec import SPContext, node_label
from autosp.errors import SequenceParallelError

DROPOUTS = {F.dropout, torch.dropout, "dropout"}


def _arguments(node: fx.Node) -> tuple[fx.Node, float, bool]:
    names = ("input", "p", "training", "inplace")
    bound = {"p": 0.5, "training": True, "inplace": False} | dict(zip(names, node.args)) | dict(node.kwargs)
    if node.target is torch.dropout:  # torch.dropout(input, p, train)
        bound["training"] = node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True)
    return bound["input"], float(bound["p"]), bool(bound["training"])


def is_sequence_dropout(ctx: SPContext, node: fx.Node) -> bool:
    if node.target not in DROPOUTS:
        return False
    x, p, training = _arguments(node)
    return ctx.is_local(x) and p > 0 and training


def rewrite(ctx: SPContext, node: fx.Node) -> None:
    """Replace dropout of a local value by (this rank's slice of the full mask) * x * 1/(1-p)."""
    x, p, _ = _arguments(node)
    if p >= 1:
        raise SequenceParallelError(f"{node_label(node)}: dropout with p={p} zeroes everything; use p < 1")
    spec = ctx.spec(x)
    value = ctx.current[x]
    empty = ctx.emit(node, torch.empty, (ctx.full_shape(x),), {"dtype": value.dtype, "device": value.device})
    mask = ctx.emit(node, "bernoulli_", (empty, 1.0 - p))
    local_mask = ctx.localize(mask, spec.dim, spec, before=node)
    kept = ctx.emit(node, torch.mul, (x, local_mask), spec=spec)
    node.target, node.args, node.kwargs = torch.mul, (kept, 1.0 / (1.0 - p)), {}
    node.meta["example_value"] = ctx.current[node] = ctx.run(node)
    ctx.specs[node] = spec
