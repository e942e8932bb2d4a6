"""The checkpointing policies as tags on the joint graph's forward nodes (``node.meta["recompute"]``, a
``CheckpointPolicy``), which torch's min-cut partitioner obeys; see `autosp.compiler.memory.partitioner` for what each policy tags."""
from __future__ import annotations

from collections.abc import Container

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from autosp.comm.library import op_name
from autosp.compiler.fx.layers import assign_layers, forward_nodes
from autosp.compiler.fx.node_kinds import (_getitem_parent, _is_mutating, _is_random, _is_tensor_or_tuple, _is_view,
                                        is_attention_forward, is_attention_value, is_pinned_value)
from autosp.compiler.memory.policy import Policy, SacPolicy


def _tag(node: fx.Node, policy: CheckpointPolicy) -> None:
    node.meta["recompute"] = policy


def _storage_base(node: fx.Node) -> fx.Node:
    """Walk views back to the node that owns the storage (saving a view pins its base anyway)."""
    while _is_view(node) and isinstance(node.args[0], fx.Node) and node.args[0].op != "placeholder":
        node = node.args[0]
    return node


def _pin_attention_and_collectives(graph: fx.Graph, forward: set[fx.Node], *, attention: bool) -> None:
    """Collectives and opaque kernels MUST_SAVE under every policy, attention too when `attention`."""
    for node in graph.nodes:
        if node in forward and (is_pinned_value(node) or (attention and is_attention_value(node))):
            _tag(node, CheckpointPolicy.MUST_SAVE)


def is_regather(node: fx.Node) -> bool:
    """A ZeRO-3 parameter gather (`autosp_sp::all_gather_shard` with regather=True) or a parameter's fetch from host
    memory (`autosp_sp::fetch_parameter`, offload=params)."""
    if node.op != "call_function":
        return False
    name = op_name(node.target)
    return name == "fetch_parameter" or (name == "all_gather_shard" and bool(
        node.args[4] if len(node.args) > 4 else node.kwargs.get("regather")))


def _regather_parameters(graph: fx.Graph, forward: set[fx.Node]) -> None:
    """ZeRO-3: each parameter gather (and fetch from host memory) and the views of its output MUST_RECOMPUTE, so
    backward gathers the parameter again instead of keeping it alive from forward (the one collective re-run by
    design; all others stay pinned)."""
    stack = [node for node in graph.nodes if node in forward and is_regather(node)]
    while stack:
        node = stack.pop()
        _tag(node, CheckpointPolicy.MUST_RECOMPUTE)
        stack.extend(user for user in node.users if user in forward and _is_view(user))


def _tag_layers(graph: fx.Graph, forward: set[fx.Node], *, recompute_attention: bool | Container[str],
                recompute: Container[str] | None = None) -> int:
    """Pin layer outputs, mark the rest of each layer (of the layers in `recompute`; default all) for
    recomputation, attention included in the layers `recompute_attention` names (True: all, False: none);
    returns the number of layers."""
    layers = assign_layers(graph, forward)
    boundaries: set[fx.Node] = set()
    for node, layer in layers.items():
        if layer is None or node.op == "placeholder":
            continue
        if any(u in forward and layers.get(u) != layer for u in node.users):
            boundaries.add(_storage_base(node))
    for node, layer in layers.items():
        if layer is None or node.op != "call_function" or "recompute" in node.meta:
            continue
        if node in boundaries:
            _tag(node, CheckpointPolicy.MUST_SAVE)
            continue
        if recompute is not None and layer not in recompute:
            continue
        parent = _getitem_parent(node)
        if parent is not None:
            continue  # getitems follow their parent below
        if _is_random(node) or _is_mutating(node) or not _is_tensor_or_tuple(node):
            continue
        if is_attention_forward(node) and not (
            recompute_attention is True or (recompute_attention is not False and layer in recompute_attention)
        ):
            continue
        _tag(node, CheckpointPolicy.PREFER_RECOMPUTE)
    for node in graph.nodes:
        parent = _getitem_parent(node)
        if parent is not None and node in forward and "recompute" not in node.meta and "recompute" in parent.meta:
            _tag(node, parent.meta["recompute"])
    return len({layer for layer in layers.values() if layer is not None})


def tag_joint_graph(joint_gm: fx.GraphModule, policy: Policy) -> None:
    """Write ``node.meta["recompute"]`` on the joint graph's forward nodes for ``policy`` (in place)."""
    graph = joint_gm.graph
    forward = forward_nodes(graph)
    full = policy.kind == SacPolicy.FULL
    # Under `off` this only matters if someone lowers torch's activation_memory_budget globally: the stock
    # partitioner pins only _c10d_functional collectives, not autosp's custom ops.
    _pin_attention_and_collectives(graph, forward, attention=policy.kind in (SacPolicy.SAC, SacPolicy.BUDGET))
    _regather_parameters(graph, forward)
    if policy.kind in (SacPolicy.SAC, SacPolicy.FULL):
        _tag_layers(graph, forward, recompute_attention=full)
