"""What one partition decided, read from the partitioned graphs: `PartitionRecord` (saved values, their bytes,
attention and collectives on either side, recomputed ops)."""
from __future__ import annotations

import functools
from typing import Any

import torch.fx as fx

from autosp.compiler.fx import getitem_source, is_attention_forward, is_collective, is_view, node_nbytes


def saved_values(fw_module: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """Forward-graph outputs handed to backward (tensors and symbols), in order."""
    (outputs,) = [n for n in fw_module.graph.nodes if n.op == "output"]
    return [o for o in outputs.args[0][num_fwd_outputs:] if isinstance(o, fx.Node)]


def view_owner(node: fx.Node, owners: dict[fx.Node, fx.Node]) -> fx.Node:
    """The node whose allocation `node`'s value lives in (`owners`: the earlier nodes'): a view's base, and so for
    each piece a multi-output view op returns (split's, unbind's: the base lives until its last piece dies); itself
    otherwise."""
    if is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        return owners[node.args[0]]
    parent = getitem_source(node)
    if parent is not None and is_view(parent):
        return owners[parent]
    return node


def saved_storages(fw_module: fx.GraphModule, saved: list[fx.Node]) -> dict[str, tuple[str, int]]:
    """For each of forward's `saved` values, the storage it keeps alive into backward, as (a key, its bytes): a view
    of a value forward made keeps that value's whole storage (a fused projection's slice keeps the projection), one
    key however many of its views are saved; a value or a view of a graph input (a parameter), its own bytes."""
    owners: dict[fx.Node, fx.Node] = {}
    for node in fw_module.graph.nodes:
        owners[node] = view_owner(node, owners)
    bases = {n: owners[n] if owners[n].op != "placeholder" else n for n in saved}
    return {n.name: (base.name, node_nbytes(base)) for n, base in bases.items()}


class PartitionRecord:
    """What one partition call decided, read from the partitioned graphs.

    It keeps the graphs' node metadata (fake values, module stacks) as the partitioner left it: a compile cache
    that stores the compiled result (inductor with AOTAutogradCache, as the workflow runs) empties every node's
    `meta` in place once compiled (torch's `serialize_graph_module`), and everything a record reports is read
    from that metadata."""

    def __init__(self, policy: str, fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_fwd_outputs: int,
                 plan: dict[str, Any] | None = None, offload: Any = None) -> None:
        self.policy = policy
        self.num_fwd_outputs = num_fwd_outputs
        self.plan = plan  # policy auto: what the budgeted planner chose (autosp.compiler.memory.planner)
        self.offload = offload  # policy auto: the OffloadReport of what the planner moved to host memory, or None
        self._graphs = (fw_module, bw_module)
        self._metas = {node: node.meta for gm in self._graphs for node in gm.graph.nodes}

    def __deepcopy__(self, memo: dict) -> PartitionRecord:
        """Shared, not copied: a record is read-only, and inductor deep-copies its config, partitioner included,
        for every graph it compiles (its repro string); the fake values held here cannot be copied."""
        return self

    def _with_meta(self, gm: fx.GraphModule) -> fx.GraphModule:
        for node in gm.graph.nodes:
            if not node.meta and node in self._metas:
                node.meta = self._metas[node]
        return gm

    @property
    def fw_module(self) -> fx.GraphModule:
        return self._with_meta(self._graphs[0])

    @property
    def bw_module(self) -> fx.GraphModule:
        return self._with_meta(self._graphs[1])

    @functools.cached_property
    def saved(self) -> list[fx.Node]:
        return saved_values(self.fw_module, self.num_fwd_outputs)

    @property
    def saved_activation_bytes(self) -> int:
        """Bytes of saved values computed by the forward (graph inputs such as parameters excluded)."""
        return sum(node_nbytes(n) for n in self.saved if n.op != "placeholder")

    @property
    def saved_input_bytes(self) -> int:
        return sum(node_nbytes(n) for n in self.saved if n.op == "placeholder")

    @property
    def attention_forwards_in_backward(self) -> int:
        return sum(is_attention_forward(n) for n in self.bw_module.graph.nodes)

    @property
    def attention_forwards_in_forward(self) -> int:
        return sum(is_attention_forward(n) for n in self.fw_module.graph.nodes)

    @property
    def collectives_in_backward(self) -> list[str]:
        return [str(n.target) for n in self.bw_module.graph.nodes if is_collective(n)]

    @property
    def recomputed_ops(self) -> int:
        """Forward ops that the backward graph re-runs."""
        return sum(
            n.op == "call_function"
            and getitem_source(n) is None
            and (n.meta.get("partitioner_tag") == "is_forward"
                 or getattr(n.target, "__name__", "") == "run_with_rng_state")
            for n in self.bw_module.graph.nodes
        )
