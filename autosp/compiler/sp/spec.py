"""Where a rank-local value sits in the global sequence, and the graph-walk state the SP steps share."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch.fx as fx
import torch.nn.functional as F

from autosp.compiler.fx import global_callee, module_path, user_path
from autosp.errors import SequenceParallelError


@dataclass(frozen=True)
class ShardSpec:
    """Dimension `dim` of a local value holds global sequence positions [start, start + length) of `global_len`.

    `outer`/`inner` describe a dimension that a reshape merged with neighbours (e.g. [B, S, V] -> [B*S, V]):
    its full extent is outer * global_len * inner, laid out outer-major, and the local one outer * length * inner.
    """

    dim: int
    global_len: int
    start: int
    length: int
    outer: int = 1
    inner: int = 1

    @property
    def full_extent(self) -> int:
        return self.outer * self.global_len * self.inner

    @property
    def local_extent(self) -> int:
        return self.outer * self.length * self.inner

    @property
    def padding(self) -> int:
        """How many positions of this shard lie beyond the end of the sequence."""
        return max(0, self.start + self.length - self.global_len)

    @property
    def merged(self) -> bool:
        return self.outer != 1 or self.inner != 1

    def at(self, dim: int, **changes: int) -> ShardSpec:
        return replace(self, dim=dim, **changes)


def canonical_spec(dim: int, seq_len: int, sp_rank: int, sp_size: int) -> ShardSpec:
    """The even, rank-ordered shard Ulysses all-to-alls assume: rank r holds [r*L, (r+1)*L), L = ceil(S/P)
    (positions past S are padding, see `padding`)."""
    length = -(-seq_len // sp_size)
    return ShardSpec(dim, seq_len, sp_rank * length, length)


def node_label(node: fx.Node) -> str:
    """A name a user can find in their model: the module path Dynamo recorded (with the module-level kernel it
    ran in, if any), else the node name."""
    path = module_path(node)
    if path is None:
        return node.name
    callee = global_callee(node)
    inside = f"{node.name} in {callee}" if callee else node.name
    return f"{user_path(path)} ({inside})"


@dataclass
class SPContext:
    """State of one SP rewrite of one graph on one rank."""

    graph: fx.Graph
    seq_len: int
    sp_rank: int
    sp_size: int
    group_name: str
    fake_mode: Any
    original: dict[fx.Node, Any]  # each node's value before the rewrite (Dynamo's fake example values)
    trainable: set[fx.Node] = field(default_factory=set)  # nodes a trainable parameter flows into
    current: dict[fx.Node, Any] = field(default_factory=dict)  # values after the rewrite
    specs: dict[fx.Node, Any] = field(default_factory=dict)  # local nodes -> ShardSpec (tuple of them for tuples)
    full_of: dict[fx.Node, fx.Node] = field(default_factory=dict)  # a localized node -> the full value it came from
    rank_local: dict[fx.Node, None] = field(default_factory=dict)  # full-shaped per-rank values (`expert_counts`)
    whole: set[fx.Node] = field(default_factory=set)  # full values computed from all-gathered shards (`sparse`)
    _localized: dict[tuple[fx.Node, ShardSpec], fx.Node] = field(default_factory=dict)
    ulysses_size: int = 0  # hybrid Ulysses x Ring: all-to-alls inside groups of this size (0: the SP degree)
    ulysses_group: str = ""
    ring_group: str = ""
    attention_chunks: int = 1  # each attention's all-to-alls and kernel in this many chunks of heads (`communicate`)

    @property
    def a2a_size(self) -> int:
        """Ranks one attention all-to-all spans (the SP degree, or the Ulysses group of the hybrid)."""
        return self.ulysses_size or self.sp_size

    @property
    def a2a_group(self) -> str:
        return self.ulysses_group or self.group_name

    @property
    def a2a_rank(self) -> int:
        return self.sp_rank % self.a2a_size

    @property
    def ring_size(self) -> int:
        return self.sp_size // self.a2a_size

    def is_local(self, node: Any) -> bool:
        return isinstance(node, fx.Node) and node in self.specs

    def spec(self, node: fx.Node) -> ShardSpec:
        spec = self.specs[node]
        if not isinstance(spec, ShardSpec):
            raise SequenceParallelError(f"{node_label(node)}: expected a tensor, got a tuple of sharded values")
        return spec

    def full_shape(self, node: fx.Node) -> tuple[int, ...]:
        """The shape a local tensor has in single-device training."""
        shape, spec = list(self.current[node].shape), self.spec(node)
        shape[spec.dim] = spec.full_extent
        return tuple(shape)

    def run(self, node: fx.Node) -> Any:
        """Propagate fake values through `node` with its current arguments (static shapes)."""
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: self.current[n])
        with self.fake_mode:
            if node.op == "call_function":
                return node.target(*args, **kwargs)
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
        raise SequenceParallelError(f"cannot evaluate {node.op} node {node.name}")

    def emit(
        self, before: fx.Node, target: Callable | str, args: tuple, kwargs: dict | None = None,
        spec: ShardSpec | None = None,
    ) -> fx.Node:
        """Insert a new node before `before`, give it a fake value and (if local) its shard spec."""
        op = "call_method" if isinstance(target, str) else "call_function"
        with self.graph.inserting_before(before):
            node = self.graph.create_node(op, target, args, kwargs or {})
        node.meta["example_value"] = self.current[node] = self.run(node)
        if "nn_module_stack" in before.meta:
            node.meta["nn_module_stack"] = before.meta["nn_module_stack"]
        if spec is not None:
            self.specs[node] = spec
        return node

    def pad(self, node: fx.Node, dim: int, amount: int, fill: float | bool, before: fx.Node) -> fx.Node:
        """`node` with `amount` positions of `fill` appended along `dim` (`autosp.compiler.sp.padding`)."""
        if not amount:
            return node
        ndim = self.current[node].dim()
        return self.emit(before, F.pad, (node, [0, 0] * (ndim - 1 - dim % ndim) + [0, amount]), {"value": fill})

    def localize(self, full: fx.Node, dim: int, spec: ShardSpec, before: fx.Node, fill: float = 0) -> fx.Node:
        """This rank's shard of a full value along `dim` (cached: one narrow per value and shard); positions past
        the end of the sequence (a padded shard) hold `fill`."""
        key = (full, spec.at(dim), fill)
        if key not in self._localized:
            # the real positions, then the padding: a narrow of `full` itself, which `index_chains` can move up
            start = min(spec.start, spec.global_len)
            real = max(0, min(spec.length, spec.global_len - spec.start))
            if spec.merged:  # [.., outer*S*inner, ..] -> [.., outer, S, inner, ..], narrow S, merge back
                node = self.emit(before, "unflatten", (full, dim, (spec.outer, spec.global_len, spec.inner)))
                node = self.emit(before, "narrow", (node, dim + 1, start, real))
                node = self.pad(node, dim + 1, spec.length - real, fill, before)
                node = self.emit(before, "flatten", (node, dim, dim + 2))
            else:
                node = self.emit(before, "narrow", (full, dim, start, real))
                node = self.pad(node, dim, spec.length - real, fill, before)
            self.specs[node] = spec.at(dim)
            self.full_of[node] = full
            self._localized[key] = node
        return self._localized[key]

