"""Attention written by hand: `matmul -> scale -> [soft-cap] -> mask -> [sinks] -> softmax -> [dropout] -> matmul`.

Models whose SDPA path is off (eager attention, logit soft-capping, attention sinks) compute attention as a chain
of ops between two matmuls. The chain is recognised in the graph from its shape, not from names: a softmax over
the last dim of [.., S, S + k] scores (k extra key columns: gpt-oss's per-head sink logits, concatenated after the
keys and dropped after the softmax), reached from a trainable [.., S, S] `q @ kT` through ops with one score input
each, and consumed by `probs @ v` over [.., S, S]. Ops computed from the chain that only feed it back (the row
max subtracted before the softmax) belong to the region. Every other input (scale, cap, mask, sink logits) must
be a full value. The pass then treats the whole region as one attention: all-to-alls on q, kT and v (heads
scattered, sequence gathered), the region runs unchanged on this rank's heads over the full sequence, and one
all-to-all brings the output back to the shard. Per-head inputs ([.., H, S, *]: masks, sinks) are cut to this
rank's heads; with a padded sequence the padded keys are hidden from real queries right before the softmax (see
`padding`). The scores of this rank's heads are [.., S, S + k], as the model's own eager attention makes them.
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
SOFTMAXES = {F.softmax, torch.softmax, "softmax"}
DROPOUTS = {F.dropout, torch.dropout, "dropout"}
_META = "autosp_eager_attention"
ALL_TO_ALL = op("all_to_all").default


@dataclass(frozen=True)
class EagerAttention:
    scores: fx.Node  # q @ kT
    softmax: fx.Node
    output: fx.Node  # probs @ v
    chain: tuple[fx.Node, ...]  # scores .. output and what only feeds them back, in graph order

    @property
    def query(self) -> fx.Node:
        return self.scores.args[0]

    @property
    def key_t(self) -> fx.Node:
        return self.scores.args[1]

    @property
    def value(self) -> fx.Node:
        return self.output.args[1]


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
    back, node = [], softmax
    while node.target not in MATMULS:  # up the score chain: the one trainable [.., S, S + k] input of each op
        inputs = [n for n in node.all_input_nodes if n in trainable and _is_scores(n)]
        if len(inputs) != 1:
            return None
        node = inputs[0]
        back.append(node)
    scores = node
    forward, node = [], softmax
    while node.target not in MATMULS:  # down: single users until `probs @ v`
        if len(node.users) != 1:
            return None
        node = next(iter(node.users))
        forward.append(node)
    output = node
    probs = forward[-2] if len(forward) > 1 else softmax
    if output.args[0] is not probs or len(scores.args) != 2 or not _is_square_scores(scores) \
            or not _is_square_scores(probs):
        return None
    chain = {*back, softmax, *forward}
    return EagerAttention(scores, softmax, output, tuple(sorted(chain | _feedback(chain, scores, output, order),
                                                               key=order.__getitem__)))


def _feedback(chain: set[fx.Node], scores: fx.Node, output: fx.Node, order: dict[fx.Node, int]) -> set[fx.Node]:
    """Nodes computed from the chain whose every use is back in the chain (or in another such node)."""
    between = [n for n in scores.graph.nodes if order[scores] < order[n] < order[output] and n not in chain]
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
    region.output.replace_input_with(v, exchange(v, seq_dim, region.output))
    per_rank = heads // ctx.sp_size
    for node in region.chain:
        for side in node.all_input_nodes:
            if side in inner or side in (q, kt, v) or side.target is ALL_TO_ALL:
                continue
            if ctx.is_local(side):
                raise SequenceParallelError(f"attention {label}: {node.name} combines the scores with a sharded "
                                            f"value ({side.name}); only full masks and constants can be")
            node.replace_input_with(side, _full_partner(ctx, side, heads, per_rank, node))
        if node is region.softmax:
            padding.hide_padding_keys(ctx, node)
        node.meta["example_value"] = ctx.current[node] = ctx.run(node)
    communicate.scatter_heads_back(ctx, region.output, seq_dim, head_dim, expected, ctx.sp_size, ctx.group_name)


def _full_partner(ctx: SPContext, side: fx.Node, heads: int, per_rank: int, before: fx.Node) -> fx.Node:
    """A full mask over [.., S, S] extended to the padded length and cut to this rank's heads."""
    from autosp.compiler.sp import padding

    shape = ctx.current[side].shape if isinstance(ctx.current[side], torch.Tensor) else ()
    node = side
    for dim in (-1, -2):
        if len(shape) >= -dim and shape[dim] == ctx.seq_len:
            node = ctx.pad(node, dim, padding.padded_length(ctx.seq_len, ctx.sp_size) - ctx.seq_len,
                                   0, before)  # any finite value: `hide_padding_keys` decides what padding sees
    if len(shape) >= 3 and shape[-3] == heads and heads > 1:
        node = ctx.emit(before, "narrow", (node, len(shape) - 3, ctx.sp_rank * per_rank, per_rank))
    return node
