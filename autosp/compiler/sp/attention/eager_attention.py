"""Attention written by hand: `matmul -> scale -> [soft-cap] -> mask -> [sinks] -> softmax -> [dropout] -> matmul
-> [gate]`.

Models whose SDPA path is off (eager attention, logit soft-capping, attention sinks) compute attention as a chain
of ops between two matmuls. The chain is recognised in the graph from its shape, not from names: a softmax over
the last dim of [.., S, S + k] scores (k extra key columns: gpt-oss's per-head sink logits, concatenated after the
keys and dropped after the softmax), reached from a trainable [.., S, S] `q @ kT` through ops with one score input
each, and consumed by `probs @ v` over [.., S, S]. Ops computed from the chain that only feed it back (the row
max subtracted before the softmax) belong to the region, and so does a gate: one `probs @ v * g` whose `g` is
computed from the scores (Granite SWA's sink, `sigmoid(logsumexp(scores) - sink)` per head and query: after the
all-to-all this rank holds every key of its heads, so the logsumexp is local). Every other input (scale, cap, mask,
sink logits) must be a full value. The pass then treats the whole region as one attention: all-to-alls on q, kT and
v (heads scattered, sequence gathered), the region runs unchanged on this rank's heads over the full sequence (each
op checked to keep the heads apart), and one all-to-all brings the output back to the shard. Per-head inputs
([.., H, S, *] masks and sinks, [1, H, 1] gate sinks) are cut to this rank's heads; with a padded sequence the
padded keys are hidden from real queries right before the softmax and the logsumexp (see `padding`). The scores of
this rank's heads are [.., S, S + k], as the model's own eager attention makes them. Keys joined along the sequence
with pooled entries (compressed attention, [.., S, S + T] scores) are not such a region: `compressed` shards them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.comm.library import op
from autosp.compiler.sp.attention import communicate
from autosp.compiler.sp.spec import SPContext, canonical_spec, node_label
from autosp.errors import SequenceParallelError

MATMULS = {torch.matmul, operator.matmul, "matmul", torch.bmm, "bmm"}
GATES = {operator.mul, torch.mul, "mul"}
LOGSUMEXPS = {torch.logsumexp, "logsumexp"}  # over the keys, as the softmax: padded keys hidden from it too
SOFTMAXES = {F.softmax, torch.softmax, "softmax"}
DROPOUTS = {F.dropout, torch.dropout, "dropout"}
_META = "autosp_eager_attention"
ALL_TO_ALL = op("all_to_all").default


@dataclass(frozen=True)
class EagerAttention:
    scores: fx.Node  # q @ kT
    softmax: fx.Node
    attend: fx.Node  # probs @ v
    output: fx.Node  # the region's last node: `attend`, or the gate on it
    chain: tuple[fx.Node, ...]  # scores .. output and what only feeds them back, in graph order

    @property
    def query(self) -> fx.Node:
        return self.scores.args[0]

    @property
    def key_t(self) -> fx.Node:
        return self.scores.args[1]

    @property
    def value(self) -> fx.Node:
        return self.attend.args[1]


def _value(node: object):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _is_square_scores(node: fx.Node) -> bool:
    v = _value(node)
    return isinstance(v, torch.Tensor) and v.dim() >= 3 and v.shape[-1] == v.shape[-2]


def _is_scores(node: fx.Node) -> bool:
    """[.., S, S + k]: scores over the S keys and k >= 0 extra columns (sinks)."""
    v = _value(node)
    return isinstance(v, torch.Tensor) and v.dim() >= 3 and v.shape[-1] >= v.shape[-2] > 1


def _softmax_dim(node: fx.Node) -> int | None:
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    return dim % _value(node).dim() if isinstance(dim, int) else None


def find(gm: fx.GraphModule, trainable: set[fx.Node]) -> list[EagerAttention]:
    """Every hand-written attention region; marks its nodes so the SP pass rewrites the region as one."""
    regions = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.target not in SOFTMAXES or not _is_scores(node) or _softmax_dim(node) != _value(node).dim() - 1:
            continue
        region = _region_around(node, trainable, order)
        if region is not None:
            regions.append(region)
            for n in region.chain:
                n.meta[_META] = region
    return regions


def _region_around(softmax: fx.Node, trainable: set[fx.Node], order: dict[fx.Node, int]) -> EagerAttention | None:
    back = _score_chain(softmax, trainable)
    if back is None:
        return None
    scores = back[-1]
    forward, node = [], softmax
    while node.target not in MATMULS:  # down: single users until `probs @ v`
        if len(node.users) != 1:
            return None
        node = next(iter(node.users))
        forward.append(node)
    attend = node
    probs = forward[-2] if len(forward) > 1 else softmax
    if attend.args[0] is not probs or len(scores.args) != 2 or not _is_square_scores(scores) \
            or not _is_square_scores(probs):
        return None
    chain = {*back, softmax, *forward}
    inside = chain | _feedback(chain, scores, attend, order)
    output = attend
    gate = next(iter(attend.users)) if len(attend.users) == 1 else None
    if gate is not None and gate.target in GATES:
        with_gate = chain | {gate}
        with_gate |= _feedback(with_gate, scores, gate, order)
        if any(g is not attend and g in with_gate for g in gate.all_input_nodes):
            inside, output = with_gate, gate
    return EagerAttention(scores, softmax, attend, output, tuple(sorted(inside, key=order.__getitem__)))


def _score_chain(softmax: fx.Node, trainable: set[fx.Node]) -> list[fx.Node] | None:
    """Up from the softmax to `q @ kT` through the one trainable [.., S, S + k] input of each op (None: no such
    chain); the matmul last."""
    back, node = [], softmax
    while node.target not in MATMULS:
        inputs = [n for n in node.all_input_nodes if n in trainable and _is_scores(n)]
        if len(inputs) != 1:
            return None
        node = inputs[0]
        back.append(node)
    return back


def _feedback(chain: set[fx.Node], scores: fx.Node, end: fx.Node, order: dict[fx.Node, int]) -> set[fx.Node]:
    """Nodes computed from the chain (between `scores` and `end`) whose every use is back in the chain (or in
    another such node)."""
    between = [n for n in scores.graph.nodes if order[scores] < order[n] < order[end] and n not in chain]
    reached = {scores} | chain
    derived = [n for n in between if any(i in reached for i in n.all_input_nodes) and not reached.add(n)]
    inside = set(chain)
    for node in reversed(derived):
        if node.users and all(u in inside for u in node.users):
            inside.add(node)
    return inside - chain


def region_of(node: fx.Node) -> EagerAttention | None:
    return node.meta.get(_META)


def rewrite(ctx: SPContext, region: EagerAttention) -> None:
    """All-to-alls around the region; the chain runs on this rank's heads over the whole (padded) sequence."""
    from autosp.compiler.sp import padding

    label = node_label(region.output)
    inner = set(region.chain)
    for n in region.chain[:-1]:
        if any(user not in inner for user in n.users):
            raise SequenceParallelError(f"attention {label}: {n.name} is also used outside the attention; AutoSP "
                                        "can rewrite hand-written attention only when its scores stay inside it")
        if n.target in DROPOUTS and n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5) \
                and n.kwargs.get("training", True):
            raise SequenceParallelError(f"attention {label} uses dropout ({n.name}): its random mask would differ "
                                        "from single-device training; set attention dropout to 0")
    q, kt, v = region.query, region.key_t, region.value
    ndim = ctx.current[q].dim()
    head_dim, seq_dim = ndim - 3, ndim - 2
    expected = canonical_spec(seq_dim, ctx.seq_len, ctx.sp_rank, ctx.sp_size)
    for t, dim in ((q, seq_dim), (kt, ndim - 1), (v, seq_dim)):
        if not ctx.is_local(t) or ctx.spec(t) != expected.at(dim):
            raise SequenceParallelError(f"attention {label}: query, key and value must be even shards of the "
                                        f"sequence in [B, H, S, D] layout")
    heads = ctx.current[q].shape[head_dim]
    if {ctx.current[kt].shape[head_dim], ctx.current[v].shape[head_dim]} != {heads} or heads % ctx.sp_size:
        raise SequenceParallelError(
            f"attention {label}: hand-written attention needs query, key and value with the same number of heads "
            f"({heads}), divisible by the SP degree {ctx.sp_size}")

    def exchange(t: fx.Node, gather_dim: int, before: fx.Node) -> fx.Node:
        return ctx.emit(before, ALL_TO_ALL, (t, head_dim, gather_dim, ctx.sp_size, ctx.group_name))

    region.scores.replace_input_with(q, exchange(q, seq_dim, region.scores))
    region.scores.replace_input_with(kt, exchange(kt, ndim - 1, region.scores))
    region.attend.replace_input_with(v, exchange(v, seq_dim, region.attend))
    per_rank = heads // ctx.sp_size
    for node in region.chain:
        computed = [n for n in node.all_input_nodes if n in inner or n.target is ALL_TO_ALL]
        for side in node.all_input_nodes:
            if side in inner or side in (q, kt, v) or side.target is ALL_TO_ALL:
                continue
            if ctx.is_local(side):
                raise SequenceParallelError(f"attention {label}: {node.name} combines the scores with a sharded "
                                            f"value ({side.name}); only full masks and constants can be")
            node.replace_input_with(side, _full_partner(ctx, side, _heads_dim(ctx, computed, heads, per_rank),
                                                        heads, per_rank, node))
        if node.target in LOGSUMEXPS and _reduced_dim(node) != ctx.current[node.args[0]].dim() - 1:
            raise SequenceParallelError(f"attention {label}: {node.name} takes a logsumexp over dim "
                                        f"{_reduced_dim(node)} of the scores; AutoSP follows one over the keys only")
        if node is region.softmax or node.target in LOGSUMEXPS:
            padding.hide_padding_keys(ctx, node)
        node.meta["example_value"] = ctx.current[node] = ctx.run(node)
        _check_per_head(ctx, node, label, heads, per_rank)
    communicate.scatter_heads_back(ctx, region.output, seq_dim, head_dim, expected, ctx.sp_size, ctx.group_name)


def _reduced_dim(node: fx.Node) -> int | None:
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    return dim % _value(node.args[0]).dim() if isinstance(dim, int) else None


def _heads_dim(ctx: SPContext, computed: list[fx.Node], heads: int, per_rank: int) -> int:
    """The heads dim, counted from the right, of the region values an op combines: the dim that went from all
    `heads` (single-process) to this rank's `per_rank` (-3 on [.., H, S, S] scores, -2 on a [.., H, S] logsumexp)."""
    for n in computed:
        before, after = ctx.original.get(n), ctx.current[n]  # an all-to-all the pass made has no original value
        if before is None:
            before = ctx.original[n.args[0]]
        for dim in range(-1, -after.dim() - 1, -1):
            if before.shape[dim] == heads and after.shape[dim] == per_rank:
                return dim
    return -3


def _check_per_head(ctx: SPContext, node: fx.Node, label: str, heads: int, per_rank: int) -> None:
    """A region op on this rank's heads must give the single-process value's shape with heads cut to this rank's
    (and the sequence padded): one that reduces or reshapes across heads would not compute what single-process does."""
    from autosp.compiler.sp import padding

    before, after = ctx.original[node], ctx.current[node]
    if not isinstance(before, torch.Tensor):
        return
    grown = padding.padded_length(ctx.seq_len, ctx.sp_size) - ctx.seq_len
    cut = [(b, a) for b, a in zip(before.shape, after.shape, strict=False) if b != a]
    if before.dim() != after.dim() or cut.count((heads, per_rank)) != 1 \
            or any(a - b != grown for b, a in cut if (b, a) != (heads, per_rank)):
        raise SequenceParallelError(f"attention {label}: {node.name} ({getattr(node.target, '__name__', node.target)})"
                                    f" mixes attention heads ({tuple(before.shape)} -> {tuple(after.shape)} on "
                                    f"{per_rank} of {heads} heads); AutoSP shards hand-written attention by heads")


def _full_partner(ctx: SPContext, side: fx.Node, heads_dim: int, heads: int, per_rank: int,
                  before: fx.Node) -> fx.Node:
    """A full mask over [.., S, S] (or a per-head sink) extended to the padded length and cut to this rank's heads
    along `heads_dim` (from the right, as broadcasting aligns it with the region value it meets)."""
    from autosp.compiler.sp import padding

    shape = ctx.current[side].shape if isinstance(ctx.current[side], torch.Tensor) else ()
    node = side
    for dim in (-1, -2):
        if len(shape) >= -dim and shape[dim] == ctx.seq_len:
            node = ctx.pad(node, dim, padding.padded_length(ctx.seq_len, ctx.sp_size) - ctx.seq_len,
                                   0, before)  # any finite value: `hide_padding_keys` decides what padding sees
    if len(shape) >= -heads_dim and shape[heads_dim] == heads and heads > 1:
        node = ctx.emit(before, "narrow", (node, len(shape) + heads_dim, ctx.sp_rank * per_rank, per_rank))
    return node
