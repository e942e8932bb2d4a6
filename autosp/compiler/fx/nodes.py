"""New FX nodes with their fake values, and the bytes of a node's value: the helpers every graph pass shares.

A pass that adds a node must give it the fake value later passes read: Dynamo's Torch-IR graphs keep it in
`meta["example_value"]` (`DYNAMO`), aot_autograd's aten graphs in `meta["val"]` (`ATEN`: the partitioner and
Inductor read it).
"""
from __future__ import annotations

import operator
from contextlib import nullcontext
from typing import Any

import torch
import torch.fx as fx
from torch._functorch import predispatch
from torch._subclasses.fake_tensor import FakeTensor

from autosp.comm.transients import nbytes

DYNAMO, ATEN = "example_value", "val"
#: entering and leaving a vmap level, as Dynamo puts them in its graph (results unused; see `has_side_effect`)
VMAP_LEVELS = (predispatch._vmap_increment_nesting, predispatch._vmap_decrement_nesting)


def fake_value(node: Any, key: str = ATEN) -> Any:
    """The fake value a node carries under `key` (a non-node argument is its own value)."""
    return node.meta.get(key) if isinstance(node, fx.Node) else node


def dynamo_value(node: Any) -> Any:
    """`fake_value` in a Dynamo graph (`meta["example_value"]`)."""
    return fake_value(node, DYNAMO)


def evaluate(op: str, target: Any, args: tuple, kwargs: dict, fake_mode: Any = None) -> Any:
    """Run a `call_function`/`call_method` on fake arguments, under `fake_mode` (default: the arguments' own)."""
    if fake_mode is None:
        fake_mode = next((v.fake_mode for v in torch.utils._pytree.tree_leaves((args, kwargs))
                          if isinstance(v, FakeTensor)), None)
    with fake_mode if fake_mode is not None else nullcontext():
        if op == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        return target(*args, **kwargs)


def emit(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None, *, key: str = ATEN) -> fx.Node:
    """A new node calling `target` (a method name for `call_method`) at the graph's insertion point, with its fake
    value under `key`."""
    node = graph.create_node("call_method" if isinstance(target, str) else "call_function", target, args, kwargs or {})
    node.meta[key] = run_fake(node, key)
    return node


def graph_call(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """`emit` into an aten graph, arguments as in a call: `graph_call(graph, aten.view.default, x, [-1])`."""
    return emit(graph, target, args, kwargs)


def run_fake(node: fx.Node, key: str = ATEN) -> Any:
    """`node`'s fake value, computed from its arguments' values under `key`."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: fake_value(n, key))
    return evaluate(node.op, node.target, args, kwargs)


def node_nbytes(node: fx.Node) -> int:
    """Bytes of a tensor-valued node from its fake value (symbolic sizes by their hint); 0 otherwise."""
    val = node.meta.get(ATEN)
    return nbytes(val) if isinstance(val, torch.Tensor) else 0


def has_side_effect(node: fx.Node) -> bool:
    """Whether dead-code elimination must keep `node`: FX's own test, plus what it misses in Dynamo's Torch-IR: an
    in-place method call (`buf[..., :d].copy_(x)`, `x.add_(y)`) and `operator.setitem`, whose result nobody reads but
    whose write into a tensor is read later (MLA's key buffer, filled by two `copy_`s into views of a `new_empty`);
    and entering or leaving a vmap level (`VMAP_LEVELS`), which the `_add_batch_dim` calls inside it need
    (`create_block_mask`'s vmaps, traced into a flex model's graph)."""
    if node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__"):
        return True
    return (node.op == "call_function" and node.target in (operator.setitem, *VMAP_LEVELS)) or node.is_impure()


def eliminate_dead_code(graph: fx.Graph) -> None:
    """`graph.eliminate_dead_code()` that keeps in-place writes and vmap levels (`has_side_effect`)."""
    graph.eliminate_dead_code(is_impure_node=has_side_effect)


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` that a pass may rewrite while `gm` stays as it is (nodes' meta dicts copied shallowly: the fake
    values are shared). Its Python code is generated when first run or read (torch's lazy graph module): the
    memory planner copies a deep model's graph per rung and runs only the chosen one."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph._codegen = gm.graph._codegen
    return _LazyGraphModule(gm, graph)
