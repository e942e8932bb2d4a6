"""Index chains on the shard: a full index value whose every use is this rank's shard is computed on the shard.

The walk keeps index tensors full and narrows them where they meet local values (`indices`, `shard`). A value
computed from positions by token-wise ops and used only through those narrows — HF's rotary cos/sin tables:
`position_ids` -> (`inv_freq @ positions` | `positions * inv_freq`) -> cat -> cos/sin -> scaling -> cast — would
still be computed, and saved for backward, at the global length on every rank. After the walk, each narrow is moved
up to its source's inputs while every user of that source takes the same narrow and the source is token-wise
along the narrowed dim, so the chain runs on S/P positions and the narrow stops at the first value something else
still needs full (`position_ids`, read by the masks and packed-sequence detection as well).

Exact by algebra: for the ops below, narrowing the output along a dim equals running the op on inputs narrowed
along the matching dims (broadcast dims of size 1 stay). Anything else — scans (`cumsum`), reductions, reshapes,
random ops, in-place ops, advanced indexing, slices of the narrowed dim — stops the narrow where it is.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autosp.compiler.sp.resize import _size_args
from autosp.compiler.sp.spec import SPContext

NARROWS = {"narrow", torch.narrow}
_CASTS = {"float", "double", "half", "bfloat16", "int", "long", "bool", "to", "type", "contiguous", "clone"}
_OPERATOR_ATEN = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "and_": "bitwise_and",
                  "or_": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not"}
_MATMULS = {torch.matmul, operator.matmul, torch.bmm, "matmul", "bmm", "__matmul__"}


def narrow_index_chains(ctx: SPContext) -> int:
    """Move narrows of full index values up their token-wise chains (see the module doc); returns how many
    index values now run on the shard."""
    moved = 0
    pending = [n for n in ctx.graph.nodes if _narrow_args(n) is not None]
    while pending:
        narrow = pending.pop()
        if narrow.graph is not ctx.graph:  # erased: an identical narrow moved up before it
            continue
        source, dim, start, length = _narrow_args(narrow)
        users = list(source.users)
        if not _is_full_index(ctx, source) or any(_narrow_args(u) != (source, dim, start, length) for u in users):
            continue
        plan = _narrowed_inputs(source, dim)
        if plan is None:
            continue
        inputs, sizes = plan
        for inp, inp_dim in inputs.items():
            local = ctx.emit(source, "narrow", (inp, inp_dim, start, length))
            source.replace_input_with(inp, local)
            pending.append(local)
        if sizes is not None:
            sizes(length)
        source.meta["example_value"] = ctx.current[source] = ctx.run(source)
        for user in users:
            if ctx.current[user].shape != ctx.current[source].shape:
                raise AssertionError(f"{source.name} on the shard is {tuple(ctx.current[source].shape)}, not "
                                     f"{tuple(ctx.current[user].shape)}")
            user.replace_all_uses_with(source)
            ctx.graph.erase_node(user)
        moved += 1
    return moved


def _narrow_args(node: fx.Node) -> tuple[fx.Node, int, int, int] | None:
    """(source, dim >= 0, start, length) of a narrow with static bounds, else None."""
    if node.op not in ("call_function", "call_method") or node.target not in NARROWS or node.kwargs:
        return None
    source, dim, start, length = node.args
    value = source.meta.get("example_value") if isinstance(source, fx.Node) else None
    if not isinstance(value, torch.Tensor) or not all(isinstance(a, int) for a in (dim, start, length)):
        return None
    return source, dim % value.dim(), start, length


def _is_full_index(ctx: SPContext, node: fx.Node) -> bool:
    """A value of the original graph that no trainable parameter flows into and the walk left full."""
    return (node.op in ("call_function", "call_method") and isinstance(ctx.original.get(node), torch.Tensor)
            and node not in ctx.trainable and not ctx.is_local(node))


def _value(node: object) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _narrowed_inputs(node: fx.Node, dim: int):
    """How `node`'s output narrowed along `dim` is computed from narrowed inputs: ({input: its dim}, a function of
    the shard length that rewrites hard-coded sizes, or None), or None when `node` is not token-wise along `dim`."""
    out = _value(node)
    if _is_pointwise(node):
        return _pointwise(node, out, dim)
    if node.op == "call_method" and node.target in _CASTS:  # only the tensor cast; a `to(other)` reads its dtype
        return {node.args[0]: dim}, None
    if node.target in _MATMULS:
        return _matmul(node, out, dim)
    rule = _SHAPE_RULES.get(_torch_name(node))
    return rule(node, out, dim) if rule is not None else None


def _torch_name(node: fx.Node) -> str | None:
    """The name of a Tensor method, `operator.getitem` or a function of `torch`."""
    if node.op == "call_method":
        return node.target
    name = getattr(node.target, "__name__", None)
    if node.target is operator.getitem or (name is not None and getattr(torch, name, None) is node.target):
        return name
    return None


def _is_pointwise(node: fx.Node) -> bool:
    """An ATen op tagged pointwise and not random, reached as a torch function, a Tensor method or an operator."""
    if node.op == "call_method":
        name = node.target.strip("_") if node.target.startswith("__") else node.target
        if node.target.endswith("_") and not node.target.startswith("__"):  # in place
            return False
    elif node.op == "call_function" and getattr(node.target, "__module__", None) == "_operator":
        name = _OPERATOR_ATEN.get(node.target.__name__, node.target.__name__)
    elif node.op == "call_function" and getattr(torch, getattr(node.target, "__name__", ""), None) is node.target:
        name = node.target.__name__
    else:
        return False
    packet = getattr(torch.ops.aten, name, None)
    if packet is None or not hasattr(packet, "overloads"):
        return False
    tags = {t for overload in packet.overloads() for t in getattr(packet, overload).tags}
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def _pointwise(node: fx.Node, out: torch.Tensor, dim: int):
    """The tensor operands, broadcast; the output must be their broadcast shape (not a reduction that shares a
    pointwise op's name: `max(x)`)."""
    operands = [a for a in (*node.args, *node.kwargs.values()) if _value(a) is not None]
    if torch.broadcast_shapes(*(_value(a).shape for a in operands)) != out.shape:
        return None
    return _broadcast(operands, out, dim)


def _broadcast(operands: list[fx.Node], out: torch.Tensor, dim: int):
    """Operands broadcast right-aligned: those holding the whole dim are narrowed, those of size 1 there stay."""
    plan: dict[fx.Node, int] = {}
    for operand in operands:
        value = _value(operand)
        inp_dim = dim - (out.dim() - value.dim())
        if inp_dim >= 0 and value.shape[inp_dim] == out.shape[dim]:
            plan[operand] = inp_dim
        elif inp_dim >= 0 and value.shape[inp_dim] != 1:
            return None
    return plan, None


def _arg(node: fx.Node, position: int, name: str, default: object = None) -> object:
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def _unsqueeze(node: fx.Node, out: torch.Tensor, dim: int):
    new = _arg(node, 1, "dim") % out.dim()
    return None if dim == new else ({node.args[0]: dim - (dim > new)}, None)


def _transpose(node: fx.Node, out: torch.Tensor, dim: int):
    a, b = _arg(node, 1, "dim0") % out.dim(), _arg(node, 2, "dim1") % out.dim()
    return {node.args[0]: b if dim == a else a if dim == b else dim}, None


def _permute(node: fx.Node, out: torch.Tensor, dim: int):
    dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
    return ({node.args[0]: dims[dim] % out.dim()}, None) if len(dims) == out.dim() else None


def _getitem(node: fx.Node, out: torch.Tensor, dim: int):
    """A basic index (ints, slices, None, Ellipsis) that keeps the narrowed dim whole."""
    source, index = node.args
    value = _value(source)
    items = list(index) if isinstance(index, tuple) else [index]
    if value is None or any(i is not None and i is not Ellipsis and type(i) not in (int, slice) for i in items):
        return None
    consuming = sum(1 for i in items if i is not None and i is not Ellipsis)
    inp, pos = 0, 0
    for item in items:
        if item is Ellipsis:
            covered = value.dim() - consuming
            if pos <= dim < pos + covered:
                return {source: inp + dim - pos}, None
            inp, pos = inp + covered, pos + covered
        elif item is None:
            if pos == dim:
                return None
            pos += 1
        elif isinstance(item, int):
            inp += 1
        else:
            if pos == dim:
                whole = item.indices(value.shape[inp]) == (0, value.shape[inp], 1)
                return ({source: inp}, None) if whole else None
            inp, pos = inp + 1, pos + 1
    return {source: inp + dim - pos}, None


def _cat(node: fx.Node, out: torch.Tensor, dim: int):
    if _arg(node, 1, "dim", 0) % out.dim() == dim:
        return None
    return {t: dim for t in _arg(node, 0, "tensors") if isinstance(t, fx.Node)}, None


def _stack(node: fx.Node, out: torch.Tensor, dim: int):
    new = _arg(node, 1, "dim", 0) % out.dim()
    return None if dim == new else ({t: dim - (dim > new) for t in _arg(node, 0, "tensors")}, None)


def _expand(node: fx.Node, out: torch.Tensor, dim: int):
    """The input is narrowed where it holds the dim (else it broadcasts), the hard-coded size becomes the shard's."""
    source = node.args[0]
    sizes, as_sequence = _size_args(node)
    if len(sizes) != out.dim() or any(isinstance(s, fx.Node) for s in sizes):
        return None
    value = _value(source)
    inp_dim = dim - (out.dim() - value.dim())
    plan = {source: inp_dim} if inp_dim >= 0 and value.shape[inp_dim] == out.shape[dim] else {}

    def resize(length: int) -> None:
        if sizes[dim] != -1:
            sizes[dim] = length
        node.args = (node.args[0], tuple(sizes)) if as_sequence else (node.args[0], *sizes)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("shape", "size")}

    return plan, resize


_SHAPE_RULES = {"unsqueeze": _unsqueeze, "transpose": _transpose, "swapaxes": _transpose, "permute": _permute,
                "getitem": _getitem, "cat": _cat, "concat": _cat, "concatenate": _cat, "stack": _stack,
                "expand": _expand}


def _matmul(node: fx.Node, out: torch.Tensor, dim: int):
    """Rows of the product come from the left operand's rows, columns from the right's, batch dims broadcast."""
    a, b = node.args[:2]
    va, vb = _value(a), _value(b)
    if va is None or vb is None or a is b or va.dim() < 2 or vb.dim() < 2 or node.kwargs:
        return None
    if dim == out.dim() - 1:
        return {b: vb.dim() - 1}, None
    if dim == out.dim() - 2:
        return {a: va.dim() - 2}, None
    return _broadcast([a, b], out, dim)
