"""Step 3, buffer resizing: hard-coded sequence sizes become the local size outside attention.

With static shapes Dynamo bakes the sequence length into `view(B, S, H, D)`, `reshape(B, S, -1)`,
`expand(B, S, ...)`. For a local input the size that carries the sequence must shrink to the shard. Which
output dim that is follows from the reshape itself: input and output dims are grouped into runs of equal
element count, and inside the sequence's group the output dim whose size is outer * S * inner (with the
elements before and after the sequence in that group) is the one that shrinks. Factories (`arange(S)`,
`zeros(B, S)`) need no resizing: they are index values computed on the full sequence (see `indices`).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autosp.compiler.sp.spec import ShardSpec, SPContext, node_label
from autosp.errors import SequenceParallelError

RESHAPES = {"view", "reshape", "_unsafe_view", torch.reshape}
EXPANDS = {"expand"}
_LIKE = {"view_as", "reshape_as", "expand_as"}


def _size_args(node: fx.Node) -> tuple[list, bool]:
    """The target sizes of a view/reshape/expand and whether they were passed as one sequence."""
    sizes = node.args[1:] if "shape" not in node.kwargs and "size" not in node.kwargs else (
        node.kwargs.get("shape", node.kwargs.get("size")),)
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        return list(sizes[0]), True
    return list(sizes), False


def _dim_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Runs of dims of `a` and `b` with equal element counts (how a reshape maps one onto the other)."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj = [], []
        pa = pb = 1
        while True:
            if pa <= pb and i < len(a) and (not gi or pa != pb or a[i] == 1):
                pa *= a[i]
                gi.append(i)
                i += 1
            elif j < len(b):
                pb *= b[j]
                gj.append(j)
                j += 1
            else:
                break
            if pa == pb and (i == len(a) or a[i] != 1) and (j == len(b) or b[j] != 1 or i == len(a)):
                break
        groups.append((gi, gj))
    return groups


def reshaped_spec(spec: ShardSpec, in_shape: tuple[int, ...], out_shape: tuple[int, ...], label: str) -> ShardSpec:
    """Where the sequence lands after reshaping a full `in_shape` into `out_shape`."""
    for gin, gout in _dim_groups(in_shape, out_shape):
        if spec.dim not in gin:
            continue
        before = math.prod(in_shape[d] for d in gin if d < spec.dim) * spec.outer
        after = spec.inner * math.prod(in_shape[d] for d in gin if d > spec.dim)
        for dim in gout:
            out_before = math.prod(out_shape[d] for d in gout if d < dim)
            out_after = math.prod(out_shape[d] for d in gout if d > dim)
            if before % out_before or after % out_after:
                continue
            outer, inner = before // out_before, after // out_after
            if out_shape[dim] == outer * spec.global_len * inner:
                return spec.at(dim, outer=outer, inner=inner)
    raise SequenceParallelError(
        f"{label} reshapes {tuple(in_shape)} -> {tuple(out_shape)} in a way that splits the sharded sequence "
        "dimension; AutoSP can follow reshapes that keep it whole or merge it with neighbours"
    )


def resize(ctx: SPContext, node: fx.Node) -> ShardSpec | None:
    """Rewrite the hard-coded sizes of a view/reshape/expand of a local value to the local shard.

    Returns the spec of the result, or None when `node` is not a reshape of a local value."""
    if node.target in _LIKE and len(node.args) > 1 and ctx.is_local(node.args[1]):
        return ctx.spec(node.args[1])  # takes the (local) shape of another shard: its spec
    if node.target not in RESHAPES and node.target not in EXPANDS:
        return None
    source = node.args[0]
    if not ctx.is_local(source):
        return None
    spec = ctx.spec(source)
    sizes, as_sequence = _size_args(node)
    out_shape = tuple(ctx.original[node].shape)
    if node.target in EXPANDS:  # sizes align with the input's dims from the right
        new_spec = spec.at(spec.dim + len(out_shape) - ctx.current[source].dim())
    else:
        new_spec = reshaped_spec(spec, ctx.full_shape(source), out_shape, node_label(node))
    out_dim = new_spec.dim
    if isinstance(sizes[out_dim], fx.Node):
        raise SequenceParallelError(f"{node_label(node)}: symbolic sizes are resized by `mark_dynamic` graphs only")
    if sizes[out_dim] != -1:
        sizes[out_dim] = new_spec.local_extent
    node.args = (source, tuple(sizes)) if as_sequence else (source, *sizes)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("shape", "size")}
    return new_spec


REPEATS = {"repeat"}


def repeated(ctx: SPContext, node: fx.Node) -> ShardSpec | None:
    """`local.repeat(f, 1)` (Llama 4's router: every token once per expert): the sequence dim becomes f copies of
    itself, a merged dim f times further out; the repeat counts are counts, not sizes, so they stay."""
    if node.target not in REPEATS or not ctx.is_local(node.args[0]) or not isinstance(ctx.specs[node.args[0]],
                                                                                       ShardSpec):
        return None
    spec = ctx.spec(node.args[0])
    counts, _ = _size_args(node)
    if any(isinstance(c, fx.Node) for c in counts):
        raise SequenceParallelError(f"{node_label(node)}: symbolic sizes are resized by `mark_dynamic` graphs only")
    dim = spec.dim + len(counts) - ctx.current[node.args[0]].dim()
    return spec.at(dim, outer=spec.outer * counts[dim])


FRESH_LIKE = {"new_zeros", "new_ones", "new_full", "new_empty"}


def fresh_like(ctx: SPContext, node: fx.Node) -> ShardSpec | None:
    """`local.new_empty(*local.shape[:-1], D)` (a buffer the model copies the shard's parts into, MLA's keys):
    sizes read off a local value keep its sequence dim, so it gets the local size and the same shard."""
    source = node.args[0]
    if node.target not in FRESH_LIKE or not ctx.is_local(source) or not isinstance(ctx.specs[source], ShardSpec):
        return None
    spec = ctx.spec(source)
    sizes, packed = _size_args(node)
    full = ctx.original[source].shape
    if len(sizes) != len(full) or sizes[spec.dim] != spec.full_extent or list(sizes[:spec.dim]) != list(
            full[:spec.dim]):
        return None
    sizes[spec.dim] = spec.local_extent
    size_args = (tuple(sizes),) if packed else tuple(sizes)
    node.args = (source, *size_args) if "size" not in node.kwargs else (source,)
    if "size" in node.kwargs:
        node.kwargs = {**node.kwargs, "size": tuple(sizes)}
    return spec
