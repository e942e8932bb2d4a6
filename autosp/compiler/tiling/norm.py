"""RMSNorms (Llama's, as HF and the project's models write it) rewritten into `autosp_sp::rms_norm`, which holds
its fp32 values for one chunk of tokens at a time, forward and backward (the `norm` part of `--tiling`; entered
from `tiling.apply_tiling`).

The chain matched in Dynamo's Torch-IR graph, each value used only by the next step:
``x32 = x.to(float32); r = rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps); out = weight * (x32 * r).to(x.dtype)``
with `weight` of shape [hidden]. Anything else (a LayerNorm, Gemma's `1 + weight`, a norm whose fp32 values have
other users) is left as it is.
"""
from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from autosp.comm.library import op
from autosp.compiler.fx import nodes as fx_nodes
from autosp.compiler.tiling import rms_norm_op  # noqa: F401  (defines the op the pass emits)
from autosp.compiler.fx.nodes import DYNAMO, dynamo_value
from autosp.compiler.fx.layers import module_path
from autosp.compiler.tiling.mlp import MIN_TILE_TOKENS

#: chunks per norm when no tile size is given: one chunk's fp32 scratch a sixteenth of the fp32 hidden state
AUTO_CHUNKS = 16


def _is(node: Any, functions: tuple, methods: tuple) -> bool:
    if not isinstance(node, fx.Node):
        return False
    return (node.op == "call_function" and node.target in functions) or (node.op == "call_method"
                                                                          and node.target in methods)


def _only_used_by(node: fx.Node, *users: fx.Node) -> bool:
    return set(node.users) <= set(users)


def _cast_to(node: Any, dtype: torch.dtype) -> fx.Node | None:
    """The input of `node` when `node` is `input.to(dtype)` (or `.float()` for fp32), else None."""
    if not _is(node, (), ("to", "float", "type")) or not isinstance(node.args[0], fx.Node):
        return None
    if node.target == "float":
        target = torch.float32
    else:
        target = next((a for a in (*node.args[1:], node.kwargs.get("dtype")) if isinstance(a, torch.dtype)), None)
        if len(node.args) > 2 or set(node.kwargs) - {"dtype"}:
            return None
    return node.args[0] if target == dtype else None


def _pair(node: fx.Node, functions: tuple, methods: tuple) -> tuple[Any, Any] | None:
    if _is(node, functions, methods) and len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1]
    return None


_MUL = ((operator.mul, torch.mul), ("mul",))
_ADD = ((operator.add, torch.add), ("add",))


def _match(out: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """(x, weight, eps) when `out` ends an RMSNorm chain (see the module doc), else None."""
    pair = _pair(out, *_MUL)
    if pair is None:
        return None
    for weight, cast in (pair, pair[::-1]):
        if not (isinstance(weight, fx.Node) and isinstance(cast, fx.Node) and _only_used_by(cast, out)):
            continue
        found = _normalised(cast)
        if found is None:
            continue
        x, eps = found
        w, v = dynamo_value(weight), dynamo_value(x)
        if isinstance(w, torch.Tensor) and w.dim() == 1 and w.shape[0] == v.shape[-1] and v.dim() >= 2:
            return x, weight, eps
    return None


def _normalised(cast: fx.Node) -> tuple[fx.Node, float] | None:
    """(x, eps) when `cast` is `(x.to(float32) * rsqrt(...)).to(x.dtype)` with every step used once."""
    product = cast.args[0] if _is(cast, (), ("to", "float", "type")) else None
    if not isinstance(product, fx.Node) or not _only_used_by(product, cast):
        return None
    pair = _pair(product, *_MUL)
    if pair is None:
        return None
    for x32, r in (pair, pair[::-1]):
        if not (isinstance(x32, fx.Node) and isinstance(r, fx.Node)) or not _only_used_by(r, product):
            continue
        x = _cast_to(x32, torch.float32)
        if x is None or _cast_to(cast, dynamo_value(x).dtype) is not product:
            continue
        eps = _inverse_rms_of(r, x32)
        if eps is not None and len(x32.users) == 2:  # the square and the product
            return x, eps
    return None


def _inverse_rms_of(r: fx.Node, x32: fx.Node) -> float | None:
    """eps when `r` is `rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)`, each step used once."""
    if not _is(r, (torch.rsqrt,), ("rsqrt",)) or len(r.args) != 1:
        return None
    shifted = r.args[0]
    pair = _pair(shifted, *_ADD) if isinstance(shifted, fx.Node) and _only_used_by(shifted, r) else None
    if pair is None:
        return None
    mean, eps = pair if isinstance(pair[1], (int, float)) else pair[::-1]
    if not isinstance(eps, (int, float)) or not _is(mean, (torch.mean,), ("mean",)) or not _only_used_by(mean, shifted):
        return None
    dims = [*mean.args[1:], mean.kwargs.get("dim")]
    dim = next((d for d in dims if d is not None), None)
    ndim = dynamo_value(x32).dim()
    if dim not in (-1, ndim - 1, (-1,), (ndim - 1,)) or mean.kwargs.get("keepdim") is not True or len(mean.args) > 2:
        return None
    square = mean.args[0]
    if not (_is(square, (torch.pow, operator.pow), ("pow",)) and _only_used_by(square, mean)
            and len(square.args) == 2 and square.args[0] is x32 and square.args[1] == 2):
        return None
    return float(eps)


def norm_chunk_tokens(num_tokens: int, tile_tokens: int | None) -> int:
    """Tokens per chunk: the tiling's tile size when given, else a sixteenth of the tokens (at least MIN_TILE_TOKENS)."""
    if tile_tokens:
        return max(1, min(num_tokens, tile_tokens))
    return max(1, min(num_tokens, max(MIN_TILE_TOKENS, math.ceil(num_tokens / AUTO_CHUNKS))))


def fuse_rms_norms(gm: fx.GraphModule, tile_tokens: int | None = None, *, upcasts_only: bool = False
                   ) -> list[dict[str, Any]]:
    """Rewrite every matched RMSNorm of `gm` into `autosp_sp::rms_norm` (in place; `upcasts_only`: only those whose
    input is not fp32 already); returns one row per norm: its module, tokens, tokens per chunk."""
    graph = gm.graph
    fused = []
    for out in list(graph.nodes):
        found = _match(out) if out.op in ("call_function", "call_method") else None
        if found is None:
            continue
        x, weight, eps = found
        value = dynamo_value(x)
        if upcasts_only and value.dtype == torch.float32:
            continue
        tokens = math.prod(int(d) for d in value.shape[:-1])
        chunk = norm_chunk_tokens(tokens, tile_tokens)
        with graph.inserting_before(out):
            call = fx_nodes.emit(graph, op("rms_norm").default, (x, weight, eps, chunk), key=DYNAMO)
            normed = fx_nodes.emit(graph, operator.getitem, (call, 0), key=DYNAMO)
        for node in (call, normed):
            node.meta["nn_module_stack"] = out.meta.get("nn_module_stack")
            node.meta["stack_trace"] = out.meta.get("stack_trace")
        out.replace_all_uses_with(normed)
        fused.append({"module": module_path(out) or "", "tokens": tokens, "chunk_tokens": chunk})
    fx_nodes.eliminate_dead_code(graph)
    graph.lint()
    gm.recompile()
    return fused
