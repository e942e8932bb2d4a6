"""Token-wise blocks (an MLP: linears and elementwise ops on the token dims only) split into tiles of tokens, each
tile's block recomputed tile by tile under SAC (the `mlp` part of `--tiling`; entered from `tiling.apply_tiling`).
A block fed by a fused RMSNorm (`tiling.norm`) takes the norm into its tiles, and the residual add after it."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from autosp.comm.library import op_name
from autosp.compiler.fx import DYNAMO, dynamo_value, emit, run_fake

#: `node.meta["custom"]` key naming the token tile a node belongs to ("<module path>#<tile>"): torch copies
#: `custom` onto the aten nodes a node traces to and onto their gradients' nodes
TILE_KEY = "autosp_tile"

#: fewest tokens per tile: below this a [T, d] x [d, V] matmul stops using the hardware well
MIN_TILE_TOKENS = 256


#: ops that act on each token independently (feature-dim matmuls, elementwise): a module made only of these
#: can run over token tiles with identical results
_TOKEN_WISE_FUNCTIONS = {
    torch._C._nn.linear, F.linear, F.silu, F.gelu, F.relu, F.sigmoid, torch.sigmoid, torch.tanh,
    torch.nn.functional.tanh,
    operator.mul, operator.add, operator.sub, torch.mul, torch.add, torch.sub,
}
_TOKEN_WISE_METHODS = {"mul", "add", "sub", "sigmoid", "tanh", "relu"}


def _is_token_wise(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _TOKEN_WISE_FUNCTIONS
    return node.op == "call_method" and node.target in _TOKEN_WISE_METHODS


def _module_regions(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """Ops of each module call, by module path (every level of Dynamo's nn_module_stack), in program order
    (the module's lifted parameters, placeholders, are its inputs, not its ops)."""
    regions: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        for path, _cls in (node.meta.get("nn_module_stack") or {}).values():
            regions.setdefault(str(path), []).append(node)
    return regions


@dataclass
class _Block:
    path: str
    nodes: list[fx.Node]
    source: fx.Node  # the one activation entering the block, [..., tokens, features]
    result: fx.Node  # the one value leaving it
    weights: list[fx.Node]  # ops inside the module that make its weights from parameters only (run once)


def _weight_ops(nodes: list[fx.Node]) -> list[fx.Node]:
    """Ops of a module call that read parameters only (graph inputs) or each other: the ZeRO-2/3 gather of a
    sharded weight, a mixed-precision cast. They do not touch the tokens, so they run once, before the tiles."""
    weights: list[fx.Node] = []
    for node in nodes:
        if all(arg.op == "placeholder" or arg in weights for arg in node.all_input_nodes):
            weights.append(node)
    return weights


def _token_wise_block(path: str, nodes: list[fx.Node]) -> _Block | None:
    """The module call as a tileable block: only token-wise ops on the tokens (weights made from parameters
    aside), one activation in, one value out, and an intermediate larger than its input (else tiling saves
    nothing)."""
    weights = _weight_ops(nodes)
    nodes = [n for n in nodes if n not in weights]
    if not nodes:
        return None
    inside = set(nodes) | set(weights)
    if not all(_is_token_wise(n) for n in nodes):
        return None
    sources = set()
    for node in nodes:
        weight = node.args[1] if node.target in (torch._C._nn.linear, F.linear) and len(node.args) > 1 else None
        for arg in node.all_input_nodes:
            if arg not in inside and arg is not weight and not (
                node.target in (torch._C._nn.linear, F.linear) and arg in node.args[2:]
            ):
                sources.add(arg)
    leaving = [n for n in nodes if any(u not in inside for u in n.users)]
    if any(u not in inside for w in weights for u in w.users):
        return None  # a weight also used outside the module (tied): left where it is
    if len(sources) != 1 or len(leaving) != 1:
        return None
    (source,), (result,) = sources, leaving
    value, out = dynamo_value(source), dynamo_value(result)
    if not isinstance(value, Tensor) or not isinstance(out, Tensor) or value.dim() < 2:
        return None
    if out.shape[:-1] != value.shape[:-1] or out.numel() > value.numel() or any(u.op == "output" for u in result.users):
        return None  # a block whose output outgrows its input (an LM head) is whole after the tiles anyway
    biggest = max(dynamo_value(n).numel() for n in nodes if isinstance(dynamo_value(n), Tensor))
    return _Block(path, nodes, source, result, weights) if biggest > value.numel() else None


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (operator.add, torch.add)) or (
        node.op == "call_method" and node.target == "add")


def _with_norm_and_residual(block: _Block) -> _Block:
    """`block` widened by the RMSNorm that feeds it (`autosp_sp::rms_norm`, read only by the block) and the residual
    add of the norm's input after it (`x + mlp(norm(x))`): each tile normalises its own tokens, so the norm's output
    is never whole, and the tiles' outputs are the layer's. `block` unchanged otherwise."""
    getter = block.source
    if not (getter.op == "call_function" and getter.target is operator.getitem and getter.args[1] == 0):
        return block
    norm = getter.args[0]
    if not (isinstance(norm, fx.Node) and norm.op == "call_function" and op_name(norm.target) == "rms_norm"
            and list(norm.users) == [getter] and all(u in block.nodes for u in getter.users)):
        return block
    x, nodes, result = norm.args[0], [norm, getter, *block.nodes], block.result
    (add, *others) = list(result.users) or [None]
    if (not others and add is not None and _is_add(add) and len(add.args) == 2 and not add.kwargs
            and set(add.args) == {x, result} and not any(u.op == "output" for u in add.users)):
        nodes, result = [*nodes, add], add
    return _Block(block.path, nodes, x, result, block.weights)


def auto_mlp_tile_tokens(num_tokens: int, features: int, intermediate: int) -> int:
    """Tokens per block tile: one tile's intermediate no larger than the block's input, at least MIN_TILE_TOKENS."""
    rows = math.ceil(num_tokens * features / intermediate)
    return max(1, min(num_tokens, max(MIN_TILE_TOKENS, rows)))


def tile_token_wise_blocks(gm: fx.GraphModule, tile_tokens: int | None = None, *,
                           halvings: int = 0) -> list[dict[str, Any]]:
    """Run each token-wise module call (the MLPs) over tiles of its tokens: split the input along the token dim,
    one copy of the block per tile, concatenate. Copies keep their module metadata, so SAC recomputes them tile
    by tile in backward; the [tokens, intermediate] values never exist whole. `halvings`: each tile (`tile_tokens`,
    else the automatic size) halved that many times, not below MIN_TILE_TOKENS (the memory planner's lever where a
    recomputed block's backward binds: its working set is a few tile-sized intermediates). Returns what was tiled."""
    graph = gm.graph
    regions = _module_regions(graph)
    blocks = [_with_norm_and_residual(b) for path, nodes in regions.items()
              if (b := _token_wise_block(path, nodes)) is not None]
    paths = {b.path for b in blocks}
    tiled = []
    for block in blocks:
        if any(block.path.startswith(p + ".") for p in paths):  # the outermost token-wise module tiles
            continue
        source = dynamo_value(block.source)
        tokens = source.shape[-2]
        intermediate = max(dynamo_value(n).shape[-1] for n in block.nodes if isinstance(dynamo_value(n), Tensor))
        size = min(tokens, tile_tokens or auto_mlp_tile_tokens(tokens, source.shape[-1], intermediate))
        size = max(min(size, MIN_TILE_TOKENS), math.ceil(size / 2**halvings))
        if size >= tokens:
            continue
        _tile_block(graph, block, size)
        tiled.append({"module": block.path, "tokens": int(tokens), "tile_tokens": int(size),
                      "with_norm": op_name(block.nodes[0].target) == "rms_norm"})
    graph.lint()
    gm.recompile()
    return tiled


def _tile_block(graph: fx.Graph, block: _Block, size: int) -> None:
    meta = block.result.meta

    def emit_in_block(target: Any, args: tuple) -> fx.Node:
        node = emit(graph, target, args, key=DYNAMO)
        node.meta["nn_module_stack"] = meta.get("nn_module_stack")
        return node

    for weight in block.weights:  # made once, ahead of every tile
        block.nodes[0].prepend(weight)
    with graph.inserting_before(block.nodes[0]):
        pieces = emit_in_block(torch.split, (block.source, size, -2))
        outputs = []
        for i in range(len(dynamo_value(pieces))):
            env = {block.source: emit_in_block(operator.getitem, (pieces, i))}
            for node in block.nodes:
                copy = graph.node_copy(node, lambda n, env=env: env.get(n, n))
                copy.meta[DYNAMO] = run_fake(copy, DYNAMO)
                copy.meta["custom"] = {**(node.meta.get("custom") or {}), TILE_KEY: f"{block.path}#{i}"}
                env[node] = copy
            outputs.append(env[block.result])
        joined = emit_in_block(torch.cat, (outputs, -2))
    block.result.replace_all_uses_with(joined)
    for node in reversed(block.nodes):
        graph.erase_node(node)
