"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-MoE-DSA) under SP, exactly: gathered keys, local queries.

A lightning indexer scores every key for each query (`relu(q_idx @ k_idx^T)` weighted over its heads) and keeps
the top k keys; their positions become the attention's mask. Both halves need every key for this rank's queries:
- the indexer: its keys (one small head, [.., D_idx, S] at the matmul) are all-gathered along the sequence, so each
  rank scores its own queries against every key and picks the same top k as single-process training;
- the attention: the first projections inside the attention module that only the keys and values are computed
  from (MLA's compressed latent, kv_lora_rank + rope dims per token) are all-gathered, every rank expands them to
  all heads' keys and values over the whole sequence, and attends its own queries (the mask's rows of its
  positions) over them.
No all-to-all: per layer a rank sends (D_idx + latent) values per token of its shard, where Ulysses would send its
queries, keys and values of every head and take the output back. The price is memory: each rank holds every
head's keys and values over the whole sequence (P times Ulysses' share); the mask is [S/P, S] rows, not [S, S].
The gathers' gradients are reduce-scatters (`autosp_sp::all_gather_sequence`). Everything computed from gathered
values alone is full (`SPContext.whole`).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autosp.comm.library import op
from autosp.compiler.fx import attention_args, is_attention, module_path
from autosp.compiler.sp import padding
from autosp.compiler.sp.spec import ShardSpec, SPContext, node_label
from autosp.errors import SequenceParallelError

_GATHER = "autosp_sparse_gather"  # meta: the sequence dim along which this node's value is all-gathered
_SPARSE = "autosp_sparse_attention"
TOPKS = {torch.topk, "topk"}
MATMULS = {torch.matmul, operator.matmul, "matmul", torch.bmm, "bmm"}
LINEARS = {torch._C._nn.linear, torch.nn.functional.linear}
VIEWS = {operator.getitem, "view", "narrow", "select", "__getitem__"}
ALL_GATHER = op("all_gather_sequence").default


def mark(gm: fx.GraphModule, seq_len: int, trainable: set[fx.Node]) -> None:
    """Marks every attention whose mask a top k over [.., S, S] indexer scores makes, and what the walk gathers for
    it: the indexer's keys at its score matmul and the attention's latents."""
    for topk in [n for n in gm.graph.nodes if n.target in TOPKS]:
        scores = _value(topk.args[0])
        if scores is None or scores.dim() < 2 or scores.shape[-1] != seq_len or scores.shape[-2] != seq_len:
            continue
        after = descendants(topk)  # the layer's own attention, and those reusing its selection (GLM's shared)
        attentions = [n for n in _in_graph_order(topk, after) if is_attention(n)
                      and attention_args(n).get("attn_mask") in after]
        indexer = next((n for n in reversed(_in_graph_order(topk, ancestors([topk])))
                        if n.target in MATMULS and _pairs_positions(n, seq_len)), None)
        if not attentions or indexer is None or indexer.args[1] not in trainable:
            continue
        keys = indexer.args[1]
        key_dim = _value(keys).dim() - 1
        if _value(keys).shape[key_dim] != seq_len:
            continue
        keys.meta[_GATHER] = key_dim
        for attention in attentions:
            args = attention_args(attention)
            latents = _latents(args["key"], args["value"], args["query"], attention, seq_len, trainable)
            for latent in latents:
                latent.meta[_GATHER] = 1
            attention.meta[_SPARSE] = tuple(node_label(n) for n in latents)  # named in a refusal


def mark_gather(node: fx.Node, dim: int) -> None:
    """The walk all-gathers `node`'s value along the sequence on `dim` once it ran on the shard (`gather`)."""
    node.meta[_GATHER] = dim


def is_sparse(node: fx.Node) -> bool:
    return _SPARSE in node.meta


def gather(ctx: SPContext, node: fx.Node) -> None:
    """After a marked node ran on this rank's shard: its full value, all-gathered along the sequence (padding
    dropped), takes its place for every user; what is computed from it alone stays full (`SPContext.whole`)."""
    dim = node.meta.get(_GATHER)
    if dim is None:
        return
    if not ctx.is_local(node) or ctx.spec(node).dim != dim:
        raise SequenceParallelError(f"{node_label(node)}: the attention it feeds gathers this value along the "
                                    f"sequence on dim {dim}, but this rank holds it as {ctx.specs.get(node)}")
    users = list(node.users)
    after = node.next
    full = ctx.emit(after, ALL_GATHER, (node, dim, ctx.sp_size, ctx.group_name))
    if padding.padded_length(ctx.seq_len, ctx.sp_size) != ctx.seq_len:
        full = ctx.emit(after, "narrow", (full, dim, 0, ctx.seq_len))
    for user in users:
        user.replace_input_with(node, full)
    ctx.whole.add(full)


def rewrite(ctx: SPContext, node: fx.Node) -> None:
    """The sparse attention itself: this rank's queries (and mask rows) over every key and value, gathered."""
    args = attention_args(node)
    query, key, value, mask = args["query"], args["key"], args["value"], args.get("attn_mask")
    label = node_label(node)
    if not ctx.is_local(query) or ctx.is_local(key) or ctx.is_local(value):
        raise SequenceParallelError(
            f"attention {label}: DeepSeek sparse attention gathers the keys and values whole and keeps the queries "
            "sharded, but here the keys or values are computed from sharded values besides the projections gathered "
            f"({', '.join(node.meta[_SPARSE]) or 'none found'})")
    if args.get("is_causal"):
        raise SequenceParallelError(f"attention {label}: a causal flag with gathered keys would align the shard's "
                                    "queries with the first keys; AutoSP shards DeepSeek sparse attention with a mask")
    spec = ctx.spec(query)
    if isinstance(mask, fx.Node) and not ctx.is_local(mask):
        mask_shape = ctx.original[mask].shape
        dim = spec.dim - (ctx.current[query].dim() - len(mask_shape))
        if mask_shape[dim] == ctx.seq_len:
            node.replace_input_with(mask, ctx.localize(mask, dim, spec, before=node))
            mask = attention_args(node)["attn_mask"]
    if isinstance(mask, fx.Node) and spec.padding:
        _open_padded_rows(ctx, node, mask, spec)
    node.meta["example_value"] = ctx.current[node] = ctx.run(node)
    ctx.specs[node] = spec


def _open_padded_rows(ctx: SPContext, node: fx.Node, mask: fx.Node, spec: ShardSpec) -> None:
    """A padded query (past the sequence's end, on the last rank) selects no key, and a row of nothing but masked
    keys is NaN: its row sees every key instead (its output is never used: padded positions are label-ignored)."""
    rows = ctx.current[mask].dim() - spec.dim  # the query dim, counted from the right
    positions = ctx.emit(node, torch.arange, (spec.start, spec.start + spec.length))
    pad = ctx.emit(node, torch.ge, (positions, ctx.seq_len))
    pad = ctx.emit(node, "view", (pad, [-1] + [1] * (rows - 1)))
    opened = ctx.emit(node, torch.logical_or, (mask, pad)) if ctx.current[mask].dtype == torch.bool else \
        ctx.emit(node, "masked_fill", (mask, pad, 0.0))
    ctx.specs[opened] = ctx.specs.get(mask, spec)
    node.replace_input_with(mask, opened)


def _value(node: object) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _pairs_positions(matmul: fx.Node, seq_len: int) -> bool:
    """`q @ k^T` over the sequence: each operand has one dim of the sequence length, the scores two."""
    values = [_value(n) for n in (matmul, *matmul.args[:2])]
    if any(v is None for v in values):
        return False
    counts = [sum(size == seq_len for size in v.shape) for v in values]
    return counts == [2, 1, 1]


def _in_graph_order(anchor: fx.Node, nodes: set[fx.Node]) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    return sorted(nodes, key=order.__getitem__)


def descendants(node: fx.Node) -> set[fx.Node]:
    """Every node that reads `node`, directly or through others."""
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    """Every node `nodes` are computed from, counting what is copied in place into views of them (MLA's keys:
    a fresh buffer filled by `copy_` into slices of it)."""
    seen, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        sources = list(node.all_input_nodes) + _written_into(node)
        for source in sources:
            if source not in seen:
                seen.add(source)
                stack.append(source)
    return seen


def _written_into(node: fx.Node) -> list[fx.Node]:
    """What in-place ops write into `node` or a view of it."""
    written, views = [], [node]
    while views:
        view = views.pop()
        for user in view.users:
            if user.args and user.args[0] is view and user.target in VIEWS:
                views.append(user)
            elif user.args and user.args[0] is view and isinstance(user.target, str) and user.target.endswith("_"):
                written.extend(user.all_input_nodes[1:])
    return written


def _latents(key: fx.Node, value: fx.Node, query: fx.Node, attention: fx.Node, seq_len: int,
             trainable: set[fx.Node]) -> tuple[fx.Node, ...]:
    """The first projections inside the attention module that only the keys and values are computed from
    (MLA: `kv_a_proj_with_mqa`'s latent; plain attention: the k and v projections)."""
    scope = module_path(attention) or ""
    for_query = ancestors([query])
    candidates = [n for n in ancestors([key, value]) - for_query
                  if n.target in LINEARS and n in trainable and (module_path(n) or "").startswith(scope)
                  and _value(n) is not None and _value(n).dim() >= 2 and _value(n).shape[1] == seq_len]
    firsts = [n for n in candidates if not (ancestors([n]) & set(candidates))]
    return tuple(firsts)
