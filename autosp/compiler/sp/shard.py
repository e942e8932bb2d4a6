"""Step 2, sequence sharding: every rank keeps its contiguous shard of each sequence-carrying value.

Shards start at the trainable frontier (see `indices`) and then flow through the graph. Where a local value meets
a full one that also runs along the sequence (a rotary table, a padding mask, shifted labels), the full one is
narrowed to the same positions. Labels are shifted by the model on the full sequence before this narrowing, so
no token at a shard boundary is lost or counted twice. Slicing a local value along the sequence
(`logits[:, :-1]`) keeps the part of the global slice this rank holds.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.compiler.sp.indices import is_index_value
from autosp.compiler.sp.spec import ShardSpec, SPContext, node_label
from autosp.errors import SequenceParallelError

# Ops whose tensor operands broadcast against each other (right-aligned dims) are the default; these differ.
_TARGET_ALIGNED = {F.cross_entropy, F.nll_loss}  # target has the input's dims minus the class dim 1
_NO_PARTNERS = {F.linear, torch.matmul, torch.bmm, torch.mm, F.embedding, operator.matmul, "matmul", "bmm", "mm"}


def localize_partners(ctx: SPContext, node: fx.Node) -> None:
    """Narrow the full index tensors that `node` combines with its local inputs to the same positions."""
    if node.target in _NO_PARTNERS:
        return
    local = next(n for n in node.all_input_nodes if ctx.is_local(n))
    if not isinstance(ctx.specs[local], ShardSpec):  # picking an element of a tuple of shards
        return
    spec = ctx.spec(local)
    local_ndim = ctx.current[local].dim()
    for inp in node.all_input_nodes:
        if ctx.is_local(inp) or not is_index_value(ctx, inp):
            continue
        shape = ctx.original[inp].shape
        fill = 0
        if node.target in _TARGET_ALIGNED:
            dim = spec.dim if spec.dim == 0 else spec.dim - 1
            fill = node.kwargs.get("ignore_index", -100)  # a padded position is never a label
        else:
            dim = spec.dim - (local_ndim - len(shape))
        if 0 <= dim < len(shape) and shape[dim] == spec.full_extent:
            node.replace_input_with(inp, ctx.localize(inp, dim, spec, before=node, fill=fill))


def _slice_bounds(spec: ShardSpec, start: int | None, stop: int | None, step: int | None, label: str):
    """Local bounds and resulting spec of the global slice [start:stop] along a local sequence dim."""
    if spec.merged:
        raise SequenceParallelError(f"{label} slices a sequence dimension merged with others; slice before reshaping")
    if step not in (None, 1):
        raise SequenceParallelError(f"{label} slices the sequence with step {step}; only step 1 can be sharded")
    lo, hi, _ = slice(start, stop).indices(spec.global_len)
    hi = max(hi, lo)
    keep_lo = min(max(spec.start, lo), spec.start + spec.length)
    keep_hi = max(min(spec.start + spec.length, hi), keep_lo)
    new_spec = ShardSpec(spec.dim, hi - lo, keep_lo - lo, keep_hi - keep_lo)
    return keep_lo - spec.start, keep_hi - spec.start, new_spec


def _index_items(index: object, ndim: int) -> list[tuple[int | None, int, object]]:
    """For each item of a getitem index: (input dim it consumes or None, output dims it yields, item)."""
    items = list(index) if isinstance(index, tuple) else [index]
    consuming = sum(1 for i in items if i is not None and i is not Ellipsis and not isinstance(i, bool))
    paired, dim = [], 0
    for item in items:
        if item is Ellipsis:
            covered = ndim - consuming
            paired.append((None, covered, item))
            dim += covered
        elif item is None or isinstance(item, bool):
            paired.append((None, 1, item))
        elif isinstance(item, int):
            paired.append((dim, 0, item))
            dim += 1
        else:  # a slice or a tensor index
            paired.append((dim, 1, item))
            dim += 1
    return paired


def slice_local(ctx: SPContext, node: fx.Node) -> ShardSpec | None:
    """Rewrite a getitem/narrow that slices a local value along the sequence; return the result's spec.

    Returns None when `node` does not slice the sequence dimension (the generic rule then applies)."""
    source = node.args[0]
    if not ctx.is_local(source) or not isinstance(ctx.specs[source], ShardSpec):
        return None
    spec = ctx.spec(source)
    label = node_label(node)
    if node.target is operator.getitem:
        paired = _index_items(node.args[1], ctx.current[source].dim())
        items = [item for _, _, item in paired]
        for position, (dim, _, item) in enumerate(paired):
            if dim != spec.dim:
                continue
            if not isinstance(item, slice) or any(isinstance(i, fx.Node) for i in items):
                raise SequenceParallelError(
                    f"{label} indexes the sharded sequence dimension with {type(item).__name__}; "
                    "only plain slices can be sharded"
                )
            if item == slice(None):
                return None
            lo, hi, new_spec = _slice_bounds(spec, item.start, item.stop, item.step, label)
            items[position] = slice(lo, hi)
            node.args = (source, tuple(items) if isinstance(node.args[1], tuple) else items[0])
            return new_spec.at(sum(yielded for _, yielded, _ in paired[:position]))
        return None
    if node.target in (torch.narrow, "narrow"):
        _, dim, start, length = node.args
        if dim % ctx.current[source].dim() != spec.dim:
            return None
        lo, hi, new_spec = _slice_bounds(spec, start, start + length, 1, label)
        node.args = (source, dim, lo, hi - lo)
        return new_spec
    return None
