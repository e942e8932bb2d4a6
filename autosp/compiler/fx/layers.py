"""Which decoder layer a node belongs to, read from Dynamo's module stack (the first ``<name>.<int>`` /
``<name>[<int>]`` in a module path, e.g. ``model.layers.3``); nodes without one (inserted by a pass) inherit their
inputs' layer. Shared by the checkpointing tags, gradient buckets, gather prefetch and offload."""
from __future__ import annotations

import re
from typing import Any

import torch.fx as fx

_LAYER_INDEX = re.compile(r"(?:\.\d+|\[\d+\]|\['\d+'\])(?=[.\[]|$)")
_GLOBAL = "G["  # Dynamo's source of a module-level object
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_DYNAMO_ROOT = re.compile(r"^L\[[^\]]*\](?:\[\d+\])*")  # the traced callable's source: L['self'], L['args'][0]
#: a parametrization's container (``torch.nn.utils.parametrize``: ``<module>.parametrizations.<param>.<i>``) belongs to
#: the module it parametrizes; its list index is no layer index
_PARAMETRIZATION = re.compile(r"(?:\.parametrizations|\['parametrizations'\]).*$")


def _stack(node: fx.Node) -> list[tuple[str, Any]]:
    """Dynamo's module stack of a node, outermost first, as (path, class) pairs."""
    return [(str(path), cls) for path, cls in (node.meta.get("nn_module_stack") or {}).values()]


def model_module(node: fx.Node) -> tuple[str, Any] | None:
    """Innermost module of the model a node was traced in, as (path, class), or None.

    HF wraps some functions as module-level kernel modules (``use_kernel_func_from_hub``: transformers 5.25's
    ``causal_conv1d_fn``); Dynamo records them as globals (``G['...'].causal_conv1d_fn``), which are no place in the
    model, so the innermost entry rooted in the traced callable is the node's module."""
    stack = _stack(node)
    inside = [entry for entry in stack if not entry[0].startswith(_GLOBAL)]
    return (inside or stack or [None])[-1]


def module_path(node: fx.Node) -> str | None:
    """Innermost module path of a node in the model (Dynamo's nn_module_stack), or None."""
    module = model_module(node)
    return module[0] if module else None


def user_path(path: str) -> str:
    """``"L['self'].model.layers.0.mlp"`` -> ``"model.layers.0.mlp"``: a module path as the model names it, without
    the traced callable Dynamo roots it at (the root itself: ``"the model"``)."""
    root = _DYNAMO_ROOT.match(path)
    if root:
        path = path[root.end():].lstrip(".") or "the model"
    return path.replace("'", "")


def global_callee(node: fx.Node) -> str | None:
    """The module-level kernel module a node runs in inside a module of the model (``causal_conv1d_fn`` in
    ``model.layers.0.conv``), or None."""
    stack = _stack(node)
    inside = any(not path.startswith(_GLOBAL) for path, _cls in stack)
    if not inside or not stack[-1][0].startswith(_GLOBAL):
        return None
    return _IDENTIFIER.findall(stack[-1][0])[-1]  # G['<module>'].causal_conv1d_fn, G['causal_conv1d_fn']


def layer_of_path(path: str | None) -> str | None:
    """``"L['self'].model.layers.3.mlp.up_proj"`` -> ``"L['self'].model.layers.3"``; None if not in a layer.
    A parametrization (ZeRO 2/3's gather, mixed precision's cast) is in its module's layer: without that, the
    ``ParametrizationList`` index made ``model.embed_tokens.parametrizations.weight.0`` a decoder layer."""
    if path is None:
        return None
    path = _PARAMETRIZATION.sub("", path)
    root = _DYNAMO_ROOT.match(path)
    start = root.end() if root else 0
    match = _LAYER_INDEX.search(path, start)
    return path[: match.end()] if match else None


def assign_layers(graph: fx.Graph, forward: set[fx.Node]) -> dict[fx.Node, str | None]:
    """Layer of each forward node; nodes without module metadata inherit the layer of their inputs when
    those agree (SP-pass inserted reshapes and collectives), else None (model-level code)."""
    layers: dict[fx.Node, str | None] = {}
    for node in graph.nodes:
        if node not in forward:
            continue
        if node.meta.get("nn_module_stack"):
            layers[node] = layer_of_path(module_path(node))
            continue
        parents = {layers.get(a) for a in node.all_input_nodes if a in forward and a.op != "placeholder"}
        layers[node] = parents.pop() if len(parents) == 1 else None
    return layers


def forward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Joint-graph nodes that do not depend on a tangent (i.e. the forward part)."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and "tangents" in str(node.target)) or any(
            a in backward for a in node.all_input_nodes
        ):
            backward.add(node)
    return {n for n in graph.nodes if n not in backward and n.op != "output"}
