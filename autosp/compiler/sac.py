"""Sequence-aware activation checkpointing (SAC): a partition function for aot_autograd.

At long sequence lengths attention dominates the FLOPs while linear/MLP work grows only linearly in S, so the
cheap way to free activation memory is to keep attention's results and recompute everything else of a decoder
layer in backward. This module steers torch's own min-cut partitioner by tagging joint-graph nodes with
``node.meta["recompute"]`` (a ``CheckpointPolicy``); it patches nothing process-wide.

Policies (``parse_policy``):
  off            the stock min-cut partitioner (collectives pinned, as everywhere);
  sac            attention ops and their outputs (out, logsumexp) MUST_SAVE, collectives MUST_SAVE (never
                 re-run), each decoder layer's outputs MUST_SAVE (so backward rebuilds one layer at a time),
                 every other forward op inside a layer PREFER_RECOMPUTE; ops outside the layers (embedding,
                 final norm, head, loss) are left to the min-cut;
  budget=<f>     attention and collectives pinned, then torch's ``activation_memory_budget`` = f;
  full           per-layer full checkpointing: only layer outputs and collectives saved, attention included
                 in the recomputation;
  auto           budgeted (``autosp.compiler.sac_auto``): the cheapest mix of the above per layer whose estimated
                 peak fits a per-rank byte budget (``budget=<bytes>``, e.g. ``budget=32MiB``; plain ``auto``:
                 the device's free memory at compile time, no limit on CPU) — nothing recomputed when all fits.

Layers are found from Dynamo's ``nn_module_stack`` (the first ``<name>.<int>`` / ``<name>[<int>]`` in a module
path, e.g. ``model.layers.3``); nodes without one (inserted by the SP pass) inherit their inputs' layer.

Note on this torch's partitioner: a node tagged PREFER_RECOMPUTE is *forced* into backward (an infinite edge to
the sink), exactly like MUST_RECOMPUTE, and a MUST_SAVE tag bans recomputation. Hence the layer outputs must be
pinned: without them every layer's recomputation would start from the embedding and all of it would be alive
at the start of backward.
"""
from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Container, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

from autosp.comm.library import op_name
from autosp.compiler.sizes import UNITS, split_size
from autosp.compiler.fx_nodes import node_nbytes
from autosp.errors import ConfigError

aten = torch.ops.aten

_ATTENTION_OP_NAMES = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_attention_math_for_mps",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
ATTENTION_FORWARD_OPS: frozenset[Any] = frozenset(
    getattr(aten, name) for name in _ATTENTION_OP_NAMES if hasattr(aten, name)
)
"""OpOverloadPackets of every attention-forward kernel an SDPA call can lower to (varies by device/dtype)."""

#: torch's namespaces whose every op communicates
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor"})
#: autosp's own custom ops (``torch.ops.autosp_sp.<name>``, `autosp.comm.library`) by what the policies may do with
#: them. Every op of the namespace is in at least one list (tests/compiler/test_sac.py), and a forward op in any of
#: them is never re-run in backward by `sac`/`budget` (``full`` recomputes attention that does not communicate):
#: collectives communicate (re-running one re-runs its communication; ZeRO-3's regather is the one exception, by
#: design); the ring's attention is both a collective and attention.
AUTOSP_COLLECTIVE_OPS = frozenset({"all_to_all", "all_reduce_sum", "all_gather_shard", "reduce_scatter_sum",
                                   "ring_attention", "ring_attention_backward"})
#: attention kernels, treated as SDPA's (the op SAC exists to keep)
AUTOSP_ATTENTION_OPS = frozenset({"masked_attention", "ring_attention"})
#: other opaque kernels, pinned like the collectives: the tiled loss makes its gradients in forward, so re-running it
#: in backward would redo the whole tiled computation; masked attention's backward is a backward op
AUTOSP_OPAQUE_OPS = frozenset({"linear_cross_entropy", "masked_attention_backward"})
#: the activation offload's copies (`autosp.compiler.offload`): inserted after partitioning, so no policy sees them
AUTOSP_OFFLOAD_OPS = frozenset({"offload", "reload", "wait"})

_LAYER_INDEX = re.compile(r"(?:\.\d+|\[\d+\]|\['\d+'\])(?=[.\[]|$)")
_DYNAMO_ROOT = re.compile(r"^L\[[^\]]*\](?:\[\d+\])*")  # the traced callable's source: L['self'], L['args'][0]
#: a parametrization's container (``torch.nn.utils.parametrize``: ``<module>.parametrizations.<param>.<i>``) belongs to
#: the module it parametrizes; its list index is no layer index
_PARAMETRIZATION = re.compile(r"(?:\.parametrizations|\['parametrizations'\]).*$")


class SacPolicy:
    """The policy kinds (``Policy.kind``)."""

    OFF = "off"
    SAC = "sac"
    FULL = "full"
    BUDGET = "budget"
    AUTO = "auto"


@dataclass(frozen=True)
class Policy:
    """A parsed ``--sac`` value. ``budget`` (a fraction) is only set for kind ``budget``; ``budget_bytes`` only
    for kind ``auto`` (None: the budget is the device's free memory at compile time, unlimited on CPU)."""

    kind: str
    budget: float | None = None
    budget_bytes: int | None = None

    def __str__(self) -> str:
        if self.kind == SacPolicy.BUDGET:
            return f"budget={self.budget:g}"
        if self.kind == SacPolicy.AUTO and self.budget_bytes is not None:
            return f"budget={self.budget_bytes}B"
        return self.kind


POLICY_CHOICES = "off, sac, full, auto, budget=<fraction in [0, 1]> or budget=<bytes, e.g. 32MiB>"


def parse_policy(value: str | bool | Policy | None) -> Policy:
    """``off | sac | full | auto | budget=<fraction in [0, 1]> | budget=<bytes with a unit, e.g. 32MiB>``
    (a byte budget is kind ``auto`` with that budget); True/False/None map to sac/off/off."""
    if isinstance(value, Policy):
        return value
    if value is None or value is False:
        return Policy(SacPolicy.OFF)
    if value is True:
        return Policy(SacPolicy.SAC)
    text = str(value).strip().lower()
    if text in (SacPolicy.OFF, SacPolicy.SAC, SacPolicy.FULL, SacPolicy.AUTO):
        return Policy(text)
    if text.startswith("budget="):
        raw = text.removeprefix("budget=").replace(" ", "")
        size = split_size(raw)
        if size is not None and size[1]:  # a unit: bytes (a bare number is a fraction)
            return Policy(SacPolicy.AUTO, budget_bytes=int(size[0] * UNITS[size[1]]))
        try:
            fraction = float(raw)
        except ValueError:
            fraction = float("nan")
        if not 0.0 <= fraction <= 1.0:  # also rejects nan
            raise ConfigError(f"--sac budget={raw!r}: write a fraction in [0, 1] (budget=0.5) or bytes with a unit "
                              "(budget=32MiB)")
        return Policy(SacPolicy.BUDGET, fraction)
    raise ConfigError(f"unknown --sac policy {value!r}; choose {POLICY_CHOICES}")


# ----------------------------------------------------------------------------------------------- node kinds


def _packet(node: fx.Node) -> Any:
    """The op's OpOverloadPacket, looking through the partitioner's RNG wrappers
    (run_and_save_rng_state(op, ...) in forward, run_with_rng_state(state, op, ...) in backward)."""
    target = node.target
    name = getattr(target, "__name__", "")
    if name == "run_and_save_rng_state" and node.args:
        target = node.args[0]
    elif name == "run_with_rng_state" and len(node.args) > 1:
        target = node.args[1]
    return getattr(target, "overloadpacket", None)


def autosp_op_name(node: fx.Node) -> str | None:
    """`name` of a call to one of the project's ops (``autosp_sp::<name>``, through the RNG wrappers), else None."""
    return op_name(_packet(node)) if node.op == "call_function" else None


def is_attention_forward(node: fx.Node) -> bool:
    return node.op == "call_function" and (_packet(node) in ATTENTION_FORWARD_OPS
                                           or autosp_op_name(node) in AUTOSP_ATTENTION_OPS)


def is_collective(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if getattr(node.target, "namespace", None) in COLLECTIVE_NAMESPACES or autosp_op_name(node) in AUTOSP_COLLECTIVE_OPS:
        return True
    return "all_to_all" in str(node.target) or "alltoall" in str(node.target)


def is_opaque(node: fx.Node) -> bool:
    """One of autosp's opaque kernels (`AUTOSP_OPAQUE_OPS`): neither attention nor a collective."""
    return autosp_op_name(node) in AUTOSP_OPAQUE_OPS


def _getitem_parent(node: fx.Node) -> fx.Node | None:
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def is_attention_value(node: fx.Node) -> bool:
    """The attention op itself or one of its outputs (out, logsumexp, ...)."""
    parent = _getitem_parent(node)
    return is_attention_forward(node) or (parent is not None and is_attention_forward(parent))


def is_collective_value(node: fx.Node) -> bool:
    parent = _getitem_parent(node)
    return is_collective(node) or (parent is not None and is_collective(parent))


def is_pinned_value(node: fx.Node) -> bool:
    """A collective or opaque kernel, or one of its outputs: saved under every policy, never re-run."""
    parent = _getitem_parent(node)
    return is_collective_value(node) or is_opaque(node) or (parent is not None and is_opaque(parent))


def _dropout_p(node: fx.Node) -> float:
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return float(value or 0.0)
    return 0.0


def _is_random(node: fx.Node) -> bool:
    """Seeded random ops are left to the partitioner; attention kernels carry the tag for their dropout,
    so they count as random only with a non-zero dropout_p."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    return not is_attention_forward(node) or _dropout_p(node) != 0.0


def _is_mutating(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(
        a.alias_info is not None and not a.alias_info.is_write for a in schema.arguments[:1]
    ) and any(r.alias_info is not None for r in schema.returns)


def _is_tensor_or_tuple(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) or (
        isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)
    )


# --------------------------------------------------------------------------------------------------- layers


def module_path(node: fx.Node) -> str | None:
    """Innermost module path of a node (Dynamo's nn_module_stack), or None."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, _cls = list(stack.values())[-1]
    return str(path)


def module_class(node: fx.Node) -> type | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    _path, cls = list(stack.values())[-1]
    return cls if isinstance(cls, type) else None


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


# ---------------------------------------------------------------------------------------------------- tags


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
    """A ZeRO-3 parameter gather (`autosp_sp::all_gather_shard` with regather=True)."""
    return (node.op == "call_function" and op_name(node.target) == "all_gather_shard"
            and bool(node.args[4] if len(node.args) > 4 else node.kwargs.get("regather")))


def _regather_parameters(graph: fx.Graph, forward: set[fx.Node]) -> None:
    """ZeRO-3: each parameter gather and the views of its output MUST_RECOMPUTE, so backward gathers the parameter
    again instead of keeping it alive from forward (the one collective re-run by design; all others stay pinned)."""
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


# ------------------------------------------------------------------------------------------ partition fn


def saved_values(fw_module: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """Forward-graph outputs handed to backward (tensors and symbols), in order."""
    (outputs,) = [n for n in fw_module.graph.nodes if n.op == "output"]
    return [o for o in outputs.args[0][num_fwd_outputs:] if isinstance(o, fx.Node)]


class PartitionRecord:
    """What one partition call decided, read from the partitioned graphs.

    It keeps the graphs' node metadata (fake values, module stacks) as the partitioner left it: a compile cache
    that stores the compiled result (inductor with AOTAutogradCache, as the workflow runs) empties every node's
    `meta` in place once compiled (torch's `serialize_graph_module`), and everything a record reports is read
    from that metadata."""

    def __init__(self, policy: str, fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_fwd_outputs: int,
                 plan: dict[str, Any] | None = None) -> None:
        self.policy = policy
        self.num_fwd_outputs = num_fwd_outputs
        self.plan = plan  # policy auto: what the budgeted planner chose (autosp.compiler.sac_auto)
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
            and _getitem_parent(n) is None
            and (n.meta.get("partitioner_tag") == "is_forward" or getattr(n.target, "__name__", "") == "run_with_rng_state")
            for n in self.bw_module.graph.nodes
        )


class SacPartitioner(CustomPartitionerFn):
    """Callable partition function for aot_autograd; also a valid ``torch._inductor.config
    .custom_partitioner_fn`` (its uuid keys Inductor's caches by policy and this file's source).

    ``records`` collects one PartitionRecord per joint graph partitioned. Under Inductor a warm AOTAutograd
    cache skips partitioning (no record); ``cacheable=False`` makes ``compile_with_partitioner`` bypass that
    cache so the records are always there."""

    def __init__(self, policy: Policy, *, cacheable: bool = True) -> None:
        self.policy = policy
        self.cacheable = cacheable
        self.records: list[PartitionRecord] = []

    def __call__(
        self, joint_gm: fx.GraphModule, joint_inputs: Sequence[object], *, num_fwd_outputs: int, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        if self.policy.kind == SacPolicy.AUTO:
            from autosp.compiler.sac_auto import plan_partition

            fw_module, bw_module, plan = plan_partition(
                joint_gm, joint_inputs, self.policy.budget_bytes, num_fwd_outputs=num_fwd_outputs, **kwargs
            )
            self.records.append(PartitionRecord(str(self.policy), fw_module, bw_module, num_fwd_outputs, plan))
            return fw_module, bw_module
        tag_joint_graph(joint_gm, self.policy)
        budget = (
            functorch_config.patch(activation_memory_budget=self.policy.budget)
            if self.policy.kind == SacPolicy.BUDGET
            else nullcontext()
        )
        with budget:
            fw_module, bw_module = min_cut_rematerialization_partition(
                joint_gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
            )
        self.records.append(PartitionRecord(str(self.policy), fw_module, bw_module, num_fwd_outputs))
        return fw_module, bw_module

    def uuid(self) -> Any:
        # Never None: Inductor would then key the artifact like the stock partitioner's.
        return (str(self.policy), get_hash_for_files((__file__, str(Path(__file__).with_name("sac_auto.py")))))


def make_partition_fn(policy: str | Policy = SacPolicy.SAC, *, cacheable: bool = True) -> SacPartitioner:
    """Partition function for ``aot_autograd(..., partition_fn=...)`` implementing ``policy``."""
    return SacPartitioner(parse_policy(policy), cacheable=cacheable)


# ---------------------------------------------------------------------------------------------- lowering


#: Inductor settings for the graphs of this backend. `allow_buffer_reuse` off: Inductor's wrapper reuses a freed
#: buffer for a later one of the same size instead of freeing it, which keeps it alive from its last use to the
#: reuse; it allows that when its own estimate of the graph's peak (`torch._inductor.memory.estimate_peak_memory`)
#: does not grow, but that estimate does not see what opaque ops allocate inside (SDPA backward's scratch, the
#: all-to-all's buffers), which is where a long sequence peaks. Measured (2 gloo ranks, `tiny`, S=15,360, ZeRO-3,
#: tiling auto, CPU meter): 4 MLP-tile buffers and 4 down-projection gradients (9.9 MiB) of layer 1's backward
#: were held through its attention backward for layer 0's MLP: peak 46.60 MiB, 39.99 MiB without the reuse
#: (aot_eager: 39.61). A freed buffer still serves a later allocation on a GPU (the caching allocator), and in-place
#: kernels (`inplace_buffers`) still write over a dying input.
INDUCTOR_MEMORY_CONFIG: dict[str, Any] = {"allow_buffer_reuse": False}


def compile_with_partitioner(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    partition_fn: SacPartitioner,
    inner: str = "inductor",
) -> Callable[..., Any]:
    """Compile a Dynamo graph for training with ``partition_fn`` deciding what backward recomputes.

    ``inductor``: Inductor's own pipeline (decompositions, joint-graph passes, caching) with the partitioner
    swapped in through ``torch._inductor.config.custom_partitioner_fn``, scoped to this call, and
    ``INDUCTOR_MEMORY_CONFIG`` for every graph it lowers.
    ``aot_eager``: aot_autograd with no-op compilers, for fast tests."""
    if inner == "inductor":
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        with inductor_config.patch(custom_partitioner_fn=partition_fn), functorch_config.patch(
            enable_autograd_cache=functorch_config.enable_autograd_cache and partition_fn.cacheable
        ):
            # config_patches, not the scope above: the backward graph is lowered lazily, at the first backward
            # call, and compile_fx re-applies its config_patches there
            return compile_fx(gm, example_inputs, config_patches=INDUCTOR_MEMORY_CONFIG)
    if inner == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd
        # torch's own aot_eager compiler: its boxed calling convention frees each input (a saved activation, in
        # backward) after its last use, as Inductor's code does; `make_boxed_func(fx_g.forward)` held them all
        # until backward's end.
        from torch._dynamo.backends.debugging import boxed_nop

        backend = aot_autograd(
            fw_compiler=boxed_nop,
            bw_compiler=boxed_nop,
            partition_fn=partition_fn,
            keep_inference_input_mutations=True,
        )
        return backend(gm, example_inputs)
    raise ConfigError(f"unknown compile backend {inner!r} for SAC lowering; choose inductor or aot_eager")


def sac_backend(
    policy: str | Policy = SacPolicy.SAC, inner: str = "aot_eager", *, cacheable: bool = True
) -> Callable[..., Any]:
    """A ``torch.compile`` backend applying ``policy`` (no SP pass): single-process SAC; the backend's
    ``partition_fn`` attribute exposes the partition records."""
    partition_fn = make_partition_fn(policy, cacheable=cacheable)

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return compile_with_partitioner(gm, example_inputs, partition_fn=partition_fn, inner=inner)

    backend.partition_fn = partition_fn  # type: ignore[attr-defined]
    return backend
