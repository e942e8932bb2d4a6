"""The SP pass: one walk over Dynamo's graph in program order that applies the paper's steps node by node.

Every value is either *full* (as in single-device training: parameters, index tensors, anything not yet touched
by the sharded sequence) or *local* (this rank's shard, described by a ShardSpec). A node becomes local at the
trainable frontier (`indices`) or when it consumes a local value; the steps then decide what it becomes:
attention gets all-to-alls (`communicate`, `flex`; DeepSeek sparse attention instead gathers its keys' latents
whole, `sparse`; DeepSeek-V4's compressed attention its keys' and pooled entries' projections, `compressed`),
causal convolutions a halo, the gated delta rule, Mamba's scans and lightning attention their incoming state from
the ranks before (`recurrence`; other recurrences are refused), sequence reductions become global (`loss`), slices
of the sequence keep this rank's part (`shard`), reshapes get local sizes (`resize`), and every other op runs
unchanged on the shard, its output spec read off the fake-tensor shapes before and after.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from autosp.compiler.fx import is_attention
from autosp.compiler.sp import dropout, expert_counts, index_chains, indices, loss, padding, resize, routing, shard
from autosp.compiler.sp.analysis import analyze
from autosp.compiler.sp.attention import (
    communicate,
    compressed,
    eager_attention,
    flex,
    flex_masks,
    hybrid,
    masks,
    sparse,
)
from autosp.compiler.sp.attribution import attributed
from autosp.compiler.sp.recurrence import conv, delta_rule, lightning, selective_scan, ssd, unsharded
from autosp.compiler.sp.spec import ShardSpec, SPContext, node_label
from autosp.errors import SequenceParallelError

# Ops that only read their input's dtype/device (sizes are their own arguments): the output is a fresh full value.
_SHAPE_AGNOSTIC = {"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"}


def sequence_parallel_pass(
    gm: fx.GraphModule, *, sp_rank: int, sp_size: int, group_name: str, ulysses_size: int | None = None,
    hybrid_groups: Callable[[int], tuple[str, str]] | None = None, attention_chunks: int = 1,
) -> fx.GraphModule:
    """Rewrite `gm` (one rank's copy) so it computes single-device training on this rank's sequence shard.

    ulysses_size: all-to-alls inside groups of this many ranks, ring attention across them (default: chosen from
    the heads, see `hybrid`); hybrid_groups(u) names this rank's (Ulysses, ring) process groups.
    attention_chunks: each SDPA and flex attention runs in this many chunks of its heads (`communicate.HeadChunks`)."""
    lightning.drop_unread_states(gm)  # lightning attention's final state, where nothing reads it
    analysis = analyze(gm)
    masks.recognise_causal_masks(gm, analysis.seq_len)  # a provably causal [S, S] mask becomes is_causal=True
    flex_masks.build_block_masks_by_rows(gm)  # flex's block mask without HF's dense [S, S] mask
    eager = any(not is_attention(site.node) for site in analysis.sites)
    ulysses = hybrid.choose_ulysses_size(analysis.sites, sp_size, ulysses_size, eager)
    groups = ("", "")
    if ulysses < sp_size:
        if hybrid_groups is None:
            raise SequenceParallelError(f"Ulysses groups of {ulysses} need process groups; compile with autosp.compile")
        groups = hybrid_groups(ulysses)
    original = {n: n.meta.get("example_value") for n in gm.graph.nodes}
    fake_mode = next(v.fake_mode for v in original.values() if isinstance(v, FakeTensor))
    ctx = SPContext(gm.graph, analysis.seq_len, sp_rank, sp_size, group_name, fake_mode, original,
                    trainable=indices.trainable_nodes(gm.graph, original),
                    ulysses_size=ulysses if ulysses < sp_size else 0, ulysses_group=groups[0], ring_group=groups[1],
                    attention_chunks=attention_chunks)
    sparse.mark(gm, analysis.seq_len, ctx.trainable)  # DeepSeek sparse attention: what to gather whole
    compressed.mark(gm, analysis.seq_len, ctx.trainable)  # DeepSeek-V4's compressed attention: the same, and its rows
    for node in list(gm.graph.nodes):
        try:
            with attributed(ctx, node):  # an internal error names this node, its module and the step that raised
                _rewrite(ctx, node)
                sparse.gather(ctx, node)
        except SequenceParallelError as e:
            raise unsharded.in_kernel(node, e) from e
    index_chains.narrow_index_chains(ctx)  # index values only ever used on the shard (rotary tables) run on it
    masks.express_structured_masks(gm, analysis.seq_len)  # window/document/padding masks as O(S) rows
    gm.graph.lint()
    gm.recompile()
    return gm


def _rewrite(ctx: SPContext, node: fx.Node) -> None:
    if node.op == "output":
        expert_counts.globalize_outputs(ctx, node)
        padding.trim_outputs(ctx, node)
    if node.op in ("placeholder", "get_attr", "output"):
        ctx.current[node] = ctx.original[node]
        return
    if sparse.is_sparse(node):
        sparse.rewrite(ctx, node)
        return
    if is_attention(node):
        communicate.rewrite_attention(ctx, node)
        return
    if flex.is_flex_attention(node):
        flex.rewrite(ctx, node)
        return
    if flex.is_output(node):
        flex.scatter(ctx, node)
        return
    region = eager_attention.region_of(node)
    if region is not None:  # hand-written attention is rewritten as one, at its last node
        if node is region.output:
            eager_attention.rewrite(ctx, region)
        return
    if compressed.is_fresh_rows(node):
        compressed.fresh_rows(ctx, node)
        return
    if not any(ctx.is_local(n) for n in node.all_input_nodes):
        if any(n in ctx.whole for n in node.all_input_nodes):  # computed from gathered values: full, as they are
            ctx.current[node] = ctx.original[node]
            ctx.whole.add(node)
            return
        if not (indices.is_frontier(ctx, node) or indices.is_token_lookup(ctx, node)):
            ctx.current[node] = ctx.original[node]
            expert_counts.follow(ctx, node)
            return
        indices.localize_frontier(ctx, node)
    else:
        routing.localize_pair_positions(ctx, node)
        shard.localize_partners(ctx, node)
        compressed.localize_rows(ctx, node)
    if dropout.is_sequence_dropout(ctx, node):
        dropout.rewrite(ctx, node)
        return
    if loss.is_sequence_reduction(ctx, node):
        loss.globalize(ctx, node)
        return
    if expert_counts.is_count(ctx, node):
        expert_counts.count_locally(ctx, node)
        return
    if delta_rule.is_gated_delta_rule(node):
        delta_rule.rewrite(ctx, node)
        return
    if ssd.is_ssd_scan(node):
        ssd.rewrite(ctx, node)
        return
    if selective_scan.is_selective_scan(node):
        selective_scan.rewrite(ctx, node)
        return
    if lightning.is_lightning_attention(node):
        lightning.rewrite(ctx, node)
        return
    if conv.is_sequence_convolution(ctx, node):
        conv.rewrite(ctx, node)
        return
    known_spec = routing.gather_spec(ctx, node) or shard.slice_local(ctx, node) or resize.resize(ctx, node) or \
        resize.repeated(ctx, node) or resize.fresh_like(ctx, node)
    node.meta["example_value"] = ctx.current[node] = ctx.run(node)
    if node.target in _SHAPE_AGNOSTIC and known_spec is None:
        return
    if known_spec is not None:
        ctx.specs[node] = known_spec
        return
    spec = _output_spec(ctx, node, ctx.original[node], ctx.current[node])
    if spec is not None:
        ctx.specs[node] = spec




def _input_spec(ctx: SPContext, node: fx.Node) -> ShardSpec:
    for n in node.all_input_nodes:
        if ctx.is_local(n):
            spec = ctx.specs[n]
            if isinstance(spec, ShardSpec):
                return spec
            return next(s for s in spec if s is not None)
    raise AssertionError(f"{node.name} has no local input")


def _output_spec(ctx: SPContext, node: fx.Node, before: Any, after: Any) -> Any:
    """Read the output's shard off the shapes: the one dim that shrank carries the sequence."""
    if isinstance(before, (tuple, list)):
        specs = tuple(_output_spec(ctx, node, b, a) for b, a in zip(before, after, strict=True))
        return specs if any(s is not None for s in specs) else None
    if not isinstance(before, torch.Tensor):
        if before != after:
            raise SequenceParallelError(
                f"{node_label(node)} reads a size of the sharded sequence ({before} -> {after})")
        return None
    changed = [d for d, (b, a) in enumerate(zip(before.shape, after.shape, strict=True)) if b != a]
    if len(changed) > 1:
        raise SequenceParallelError(
            f"{node_label(node)} ({node.target}) combines two sharded sequence dimensions (shape "
            f"{tuple(before.shape)}): an attention pattern AutoSP cannot rewrite; use scaled_dot_product_attention"
        )
    spec = _input_spec(ctx, node)
    if not changed:
        if before.numel() and spec.length != spec.global_len:
            raise SequenceParallelError(
                f"{node_label(node)} ({node.target}) reduces over the sharded sequence; AutoSP makes sum, mean and "
                "token losses global, not this op"
            )
        return None
    dim = changed[0]
    if before.shape[dim] != spec.full_extent or after.shape[dim] != spec.local_extent:
        raise SequenceParallelError(
            f"{node_label(node)} ({node.target}) changes the sharded sequence dimension "
            f"({tuple(before.shape)} -> {tuple(after.shape)}) in a way AutoSP cannot follow"
        )
    return spec.at(dim)
