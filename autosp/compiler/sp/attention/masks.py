"""Attention masks: a mask the graph proves causal becomes `is_causal=True`; no [S, S] mask is built for it.

HF transformers (traced with `use_cache=False`, as training runs) builds an explicit boolean [B, 1, S, S] mask in
the graph and passes it to SDPA. Kept, it costs every rank O(S^2) memory (16 GiB at 128K tokens) and keeps SDPA
off its mask-free kernels. This module reads the mask's construction off the graph and, where it can *prove* the
mask is the causal pattern `kv <= q`, passes `is_causal=True` instead and drops the mask subgraph.

The proof. The *pairwise region* is the set of mask ancestors whose value has two trailing dims of size S
(query, key). Every region node must be an elementwise op on broadcast operands (comparisons, logical
and/or/not, dtype-preserving `to`, `expand`), boolean `ones`, or `tril`/`triu` (which keep kv - q <= / >= their
diagonal), so mask[b, h, q, kv] is a pointwise function of the region's
inputs (leaves), each of which varies along at most one of q and kv. A leaf counts only if it is a *constant*
of the graph: computed from `arange`/literals alone (no input, parameter, buffer or random op), so the value
this compiled graph will see at run time is the one we compute now at compile time (static shapes: the pass
runs once per length). Evaluated, a leaf is classified exactly: `q + c` or `kv + c` (an integer row whose every
element equals its query/key position plus c, for all b and h), or a single value everywhere; anything else
is unknown and the proof stops. Every region value is then a function of d = kv - q alone (a comparison of
`kv + a` with `q + c` is `d + a OP c`; an elementwise op of such functions is another), which we represent
exactly as its values on the only d that occur, -(S-1)..S-1, and the mask is causal iff that vector equals
`d <= 0` and it is constant over b and h. So an off-by-one diagonal (`kv < q`), a window (`q - kv < w` with
w < S), a padding or document mask built from user inputs, or anything the rules do not cover is kept.

A mask that stays, with two dims of size S, gets a one-line warning naming its per-rank cost.
"""
from __future__ import annotations

import json
import math
import operator
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autosp.comm.library import op
from autosp.compiler.sp.attention import masked_attention  # noqa: F401  (registers autosp_sp::masked_attention)
from autosp.compiler.fx.sdpa import attention_args, is_attention
from autosp.compiler.sp.spec import node_label

_COMPARISONS = {operator.le: torch.le, operator.lt: torch.lt, operator.ge: torch.ge, operator.gt: torch.gt,
                operator.eq: torch.eq, operator.ne: torch.ne, torch.le: torch.le, torch.lt: torch.lt,
                torch.ge: torch.ge, torch.gt: torch.gt, torch.eq: torch.eq, torch.ne: torch.ne,
                "le": torch.le, "lt": torch.lt, "ge": torch.ge, "gt": torch.gt, "eq": torch.eq, "ne": torch.ne}
_LOGICAL = {operator.and_: torch.logical_and, operator.or_: torch.logical_or, torch.logical_and: torch.logical_and,
            torch.logical_or: torch.logical_or, torch.bitwise_and: torch.logical_and,
            torch.bitwise_or: torch.logical_or, "__and__": torch.logical_and, "__or__": torch.logical_or,
            "logical_and": torch.logical_and, "logical_or": torch.logical_or}
_NEGATIONS = {operator.invert, torch.logical_not, torch.bitwise_not, "logical_not", "__invert__", "bitwise_not"}
_VALUE_PRESERVING = {"expand", "expand_as", "to", "contiguous", "clone"}  # `to` only when the dtype is unchanged
_ONES = {torch.ones, torch.ones_like, "new_ones"}
_TRIANGLES = {torch.tril: torch.le, "tril": torch.le, torch.triu: torch.ge, "triu": torch.ge}  # kv - q OP diagonal
RANDOM = ("rand", "normal", "bernoulli", "dropout", "uniform", "multinomial", "poisson", "exponential", "empty")


@dataclass(frozen=True)
class _Position:
    """A leaf equal to its query ("q") or key ("kv") position plus `offset` everywhere."""
    axis: str
    offset: int


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else node


def _is_pairwise(node: Any, seq_len: int) -> bool:
    value = _value(node)
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[-2:]) == (seq_len, seq_len)


def _constant_value(gm: fx.GraphModule, node: fx.Node, budget: int) -> torch.Tensor | None:
    """The run-time value of `node` if it is a constant of the graph (no inputs, no randomness), else None."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> bool:
        if n in seen:
            return True
        seen.add(n)
        name = getattr(n.target, "__name__", str(n.target))
        value = _value(n)
        if n.op not in ("call_function", "call_method") or any(word in name for word in RANDOM):
            return False
        if isinstance(value, torch.Tensor) and value.numel() > budget:
            return False
        if not all(visit(i) for i in n.all_input_nodes):
            return False
        order.append(n)
        return True

    if not visit(node):
        return None
    env: dict[fx.Node, Any] = {}
    for n in order:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda i: env[i])
        env[n] = n.target(*args, **kwargs) if n.op == "call_function" else getattr(args[0], n.target)(*args[1:],
                                                                                                        **kwargs)
    value = env[node]
    # on the host: the classifier compares it with index vectors it builds there (a CUDA graph's constant
    # otherwise meets a CPU arange: "Expected all tensors to be on the same device", seen on an H200)
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _classify(value: Any, seq_len: int) -> Any:
    """A leaf as a _Position, a Python scalar (one value everywhere), or None (unknown)."""
    if not isinstance(value, torch.Tensor):
        return value if isinstance(value, (bool, int)) else None
    if value.numel() and bool((value == value.reshape(-1)[0]).all()):
        return value.reshape(-1)[0].item()
    if value.dtype.is_floating_point or value.dtype == torch.bool or value.dim() < 1:
        return None
    positions = torch.arange(seq_len, dtype=value.dtype)
    if value.shape[-1] == seq_len and (value.dim() < 2 or value.shape[-2] == 1):
        axis, index = "kv", positions
    elif value.dim() >= 2 and value.shape[-2] == seq_len and value.shape[-1] == 1:
        axis, index = "q", positions[:, None]
    else:
        return None
    offset = value.reshape(-1)[0].item()
    return _Position(axis, offset) if bool((value == index + offset).all()) else None


def _as_pattern(x: Any, d: torch.Tensor) -> torch.Tensor | None:
    """A region value as its values over d = kv - q (a bool/int vector), or None if it is not such a function."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, bool):
        return torch.full_like(d, x, dtype=torch.bool)
    if isinstance(x, int):
        return torch.full_like(d, x)
    return None


def _compare(op: Any, a: Any, b: Any, d: torch.Tensor) -> Any:
    if isinstance(a, _Position) and isinstance(b, _Position):
        if a.axis == b.axis:
            return None  # q vs q: a function of q alone, not of d
        if a.axis == "q":  # q + a OP kv + b  <=>  (-d) + a OP b ... normalise to kv on the left by flipping
            flipped = {torch.le: torch.ge, torch.lt: torch.gt, torch.ge: torch.le, torch.gt: torch.lt,
                       torch.eq: torch.eq, torch.ne: torch.ne}[op]
            return _compare(flipped, b, a, d)
        return op(d + a.offset, torch.tensor(b.offset))  # kv + a OP q + c  <=>  d + a OP c
    if isinstance(a, _Position) or isinstance(b, _Position):
        return None
    pa, pb = _as_pattern(a, d), _as_pattern(b, d)
    return None if pa is None or pb is None else op(pa, pb)


def _evaluate_region(gm: fx.GraphModule, mask: fx.Node, seq_len: int) -> torch.Tensor | None:
    """The mask as a bool vector over d = kv - q in [-(S-1), S-1], or None if the rules cannot prove it is one."""
    d = torch.arange(-(seq_len - 1), seq_len)
    budget = 64 * seq_len + math.prod(_value(mask).shape[:-2]) * seq_len * 2
    memo: dict[fx.Node, Any] = {}

    def abstract(arg: Any) -> Any:
        if not isinstance(arg, fx.Node):
            return _classify(arg, seq_len)
        if arg not in memo:
            memo[arg] = visit(arg)
        return memo[arg]

    def visit(node: fx.Node) -> Any:
        if not _is_pairwise(node, seq_len):
            return _classify(_constant_value(gm, node, budget), seq_len)
        target = node.target
        args = node.args
        if target in _COMPARISONS and len(args) == 2:
            return _compare(_COMPARISONS[target], abstract(args[0]), abstract(args[1]), d)
        if target in _LOGICAL and len(args) == 2:
            a, b = (_as_pattern(abstract(x), d) for x in args)
            if a is None or b is None or a.dtype != torch.bool or b.dtype != torch.bool:
                return None  # logical only: `&` of integers is bitwise
            return _LOGICAL[target](a, b)
        if target in _NEGATIONS and len(args) == 1:
            a = _as_pattern(abstract(args[0]), d)
            return None if a is None or a.dtype != torch.bool else ~a
        if target in _ONES and _value(node).dtype == torch.bool:
            return True
        if target in _TRIANGLES:
            inner = _as_pattern(abstract(args[0]), d)
            diagonal = args[1] if len(args) > 1 else node.kwargs.get("diagonal", 0)
            if inner is None or inner.dtype != torch.bool or not isinstance(diagonal, int):
                return None
            return inner & _TRIANGLES[target](d, diagonal)
        if target in _VALUE_PRESERVING and node.op == "call_method":
            if _value(node).dtype != _value(args[0]).dtype:
                return None
            return abstract(args[0])
        return None

    pattern = abstract(mask)
    pattern = _as_pattern(pattern, d) if not isinstance(pattern, _Position) else None
    return pattern if pattern is not None and pattern.dtype == torch.bool else None


def is_provably_causal(gm: fx.GraphModule, mask: fx.Node, seq_len: int) -> bool:
    """True only if `mask` is, for every batch row and head, exactly `kv <= q` (see the module docstring)."""
    value = _value(mask)
    if not _is_pairwise(mask, seq_len) or value.dtype != torch.bool:
        return False
    pattern = _evaluate_region(gm, mask, seq_len)
    if pattern is None:
        return False
    d = torch.arange(-(seq_len - 1), seq_len)
    return bool(torch.equal(pattern, d <= 0))


def _masked_attentions(gm: fx.GraphModule,
                       accept: Callable[[dict, fx.Node], bool]) -> Iterator[tuple[fx.Node, dict, fx.Node]]:
    """(node, its SDPA arguments, its mask node) for each attention whose mask is a graph value `accept`s."""
    for node in list(gm.graph.nodes):
        if not is_attention(node):
            continue
        args = attention_args(node)
        mask = args["attn_mask"]
        if isinstance(mask, fx.Node) and accept(args, mask):
            yield node, args, mask


def recognise_causal_masks(gm: fx.GraphModule, seq_len: int) -> int:
    """Rewrite each SDPA whose mask is provably causal to `is_causal=True`; drop dead mask nodes. Returns the count."""
    rewritten = 0
    proofs: dict[fx.Node, bool] = {}
    for node, args, mask in _masked_attentions(gm, lambda args, mask: not args["is_causal"]):
        if mask not in proofs:
            proofs[mask] = is_provably_causal(gm, mask, seq_len)
        if proofs[mask]:
            node.args = (args["query"], args["key"], args["value"])
            node.kwargs = {**{k: v for k, v in args.items() if k not in ("query", "key", "value")},
                           "attn_mask": None, "is_causal": True}
            rewritten += 1
    _erase_dead_mask_nodes(gm, [m for m, causal in proofs.items() if causal])
    return rewritten


def express_structured_masks(gm: fx.GraphModule, seq_len: int) -> int:
    """Replace each SDPA whose [S, S] mask is an elementwise program of O(S) rows by `autosp_sp::masked_attention`
    on those rows; drop the mask subgraph. Returns the count; a mask that stays dense gets a warning of its cost.

    Exact by construction: the program is the region's own ops in order, and elementwise broadcast ops commute
    with taking a block of query rows, which is all the op does to the rows."""
    expressed = 0
    programs: dict[fx.Node, Any] = {}
    for node, args, mask in _masked_attentions(gm, lambda args, mask: _is_pairwise(mask, seq_len)):
        if mask not in programs:
            programs[mask] = _mask_program(mask, seq_len)
        if programs[mask] is None:
            _warn_dense(node, mask)
            continue
        rows, program = programs[mask]
        with gm.graph.inserting_before(node):
            replacement = gm.graph.call_function(
                op("masked_attention").default,
                (args["query"], args["key"], args["value"], rows, program, args["scale"], bool(args["enable_gqa"])))
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        expressed += 1
    _erase_dead_mask_nodes(gm, [m for m, p in programs.items() if p is not None])
    return expressed


_PROGRAM_OPS = {
    **{k: v.__name__ for k, v in _COMPARISONS.items()},
    operator.and_: "and", operator.or_: "or", torch.logical_and: "and", torch.logical_or: "or",
    "__and__": "and", "__or__": "or", "logical_and": "and", "logical_or": "or",
    operator.add: "add", operator.sub: "sub", torch.add: "add", torch.sub: "sub", "add": "add", "sub": "sub",
    **{k: "not" for k in _NEGATIONS},
    **{k: "same" for k in _VALUE_PRESERVING},
}


class _NotStructured(Exception):
    pass


def _is_row(value: Any, seq_len: int) -> bool:
    """A tensor that varies along at most one of query/key positions and holds no head dim: O(B * S)."""
    if not isinstance(value, torch.Tensor):
        return False
    shape = (1,) * max(0, 3 - value.dim()) + tuple(value.shape)
    return shape[-3] == 1 and shape[-2] in (1, seq_len) and shape[-1] in (1, seq_len) and \
        (shape[-2], shape[-1]) != (seq_len, seq_len)


def _mask_program(mask: fx.Node, seq_len: int) -> tuple[list[fx.Node], str] | None:
    """(rows, program) computing `mask` from O(S) rows with the region's own elementwise ops, or None."""
    value = _value(mask)
    if value.dtype != torch.bool or (value.dim() >= 3 and value.shape[-3] != 1):
        return None  # a float (additive) mask, or one with a head dim
    rows: list[fx.Node] = []
    steps: list[list] = []
    step_of: dict[fx.Node, int] = {}

    def operand(arg: Any) -> list:
        if not isinstance(arg, fx.Node):
            if isinstance(arg, (bool, int, float)):
                return ["const", arg]
            raise _NotStructured
        if _is_pairwise(arg, seq_len):
            return ["step", visit(arg)]
        if not _is_row(_value(arg), seq_len):
            raise _NotStructured
        if arg not in rows:
            rows.append(arg)
        return ["row", rows.index(arg)]

    def visit(node: fx.Node) -> int:
        if node not in step_of:
            op = _PROGRAM_OPS.get(node.target)
            if op is None or (op == "same" and _value(node).dtype != _value(node.args[0]).dtype):
                raise _NotStructured
            if op in ("and", "or", "not") and _value(node).dtype != torch.bool:
                raise _NotStructured  # bitwise on integers
            if op in ("add", "sub") and (len(node.args) != 2 or node.kwargs):
                raise _NotStructured  # alpha=
            operands = node.args[:1] if op in ("same", "not") else node.args
            steps.append([op, *(operand(a) for a in operands)])
            step_of[node] = len(steps) - 1
        return step_of[node]

    try:
        visit(mask)
    except _NotStructured:
        return None
    return rows, json.dumps(steps)


def _warn_dense(attention: fx.Node, mask: fx.Node) -> None:
    value = _value(mask)
    size = value.numel() * value.element_size()
    warnings.warn(
        f"AutoSP keeps the dense {tuple(value.shape)} {value.dtype} attention mask of {node_label(attention)}: "
        f"{size / 2**20:.1f} MiB per rank, O(S^2) in the sequence length", stacklevel=2)


def _erase_dead_mask_nodes(gm: fx.GraphModule, masks: list[fx.Node]) -> None:
    """Erase the mask subgraphs that nothing uses any more (pure tensor ops only)."""
    pending, erased = list(masks), set()
    while pending:
        node = pending.pop()
        if node in erased or node.users or node.op not in ("call_function", "call_method") or is_attention(node):
            continue
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        erased.add(node)
        pending.extend(inputs)
