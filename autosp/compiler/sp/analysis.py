"""Step 1, analysis: find attention and read the model's batch/sequence/head layout off the graph.

No user tags: the sequence length is the query length every `scaled_dot_product_attention` (or flex_attention)
sees (or, in a model without attention such as Mamba2, what its recurrences' scans see: `recurrence`), and the
sequence-carrying inputs are the user inputs with a dimension of that size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from autosp.compiler.fx import attention_args, is_attention
from autosp.compiler.sp import indices
from autosp.compiler.sp.attention import compressed, eager_attention, flex
from autosp.compiler.sp.recurrence import delta_rule, lightning, selective_scan, ssd
from autosp.compiler.sp.spec import node_label
from autosp.errors import SequenceParallelError


@dataclass(frozen=True)
class AttentionSite:
    node: fx.Node
    layer: str
    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int


@dataclass(frozen=True)
class SequenceAnalysis:
    seq_len: int
    sites: tuple[AttentionSite, ...]
    sequence_inputs: tuple[tuple[str, int], ...]  # (placeholder name, dim of size seq_len)

    @property
    def heads(self) -> int:
        return self.sites[0].heads


def analyze(gm: fx.GraphModule) -> SequenceAnalysis:
    sites = []
    for node in gm.graph.nodes:
        if not (is_attention(node) or flex.is_flex_attention(node)):
            continue
        q, k = (n.meta["example_value"] for n in _query_key(node))
        if q.dim() < 3:
            raise SequenceParallelError(f"attention {node_label(node)} has a {q.dim()}-D query; expected [B, H, S, D]")
        if q.shape[-2] != k.shape[-2]:
            raise SequenceParallelError(
                f"attention {node_label(node)} has query length {q.shape[-2]} != key length {k.shape[-2]} "
                "(a KV cache or cross-attention): AutoSP shards self-attention over one sequence only"
            )
        sites.append(AttentionSite(node, node_label(node), math.prod(q.shape[:-3]), q.shape[-3], k.shape[-3],
                                   q.shape[-2], q.shape[-1]))
    trainable = indices.trainable_nodes(gm.graph, {n: n.meta.get("example_value") for n in gm.graph.nodes})
    for region in eager_attention.find(gm, trainable):
        q = region.query.meta["example_value"]
        sites.append(AttentionSite(region.output, node_label(region.output), math.prod(q.shape[:-3]), q.shape[-3],
                                   q.shape[-3], q.shape[-2], q.shape[-1]))
    # a recurrence's scan (Mamba2 has no attention at all) mixes along the sequence as attention does: [B, S, ...]
    # (Mamba1's [B, D, S], lightning attention's [B, H, S, D])
    scans = {n.args[0].meta["example_value"].shape[1] for n in gm.graph.nodes
             if delta_rule.is_gated_delta_rule(n) or ssd.is_ssd_scan(n)}
    scans |= {n.args[0].meta["example_value"].shape[2] for n in gm.graph.nodes
              if selective_scan.is_selective_scan(n) or lightning.is_lightning_attention(n)}
    scans |= {attention.queries for attention in compressed.find(gm, trainable)}  # keys joined with pooled entries
    if not sites and not scans:
        raise SequenceParallelError(
            "no attention found: AutoSP looks for torch.nn.functional.scaled_dot_product_attention, a hand-written "
            "softmax(q @ k.transpose(-2, -1)) @ v, or a recurrence kernel it shards in the model's graph"
        )
    lengths = {s.seq_len for s in sites} | scans
    if len(lengths) > 1:
        raise SequenceParallelError(f"attention and recurrent layers see different sequence lengths {sorted(lengths)}")
    seq_len = lengths.pop()
    sequence_inputs = tuple(
        (n.name, dim)
        for n in gm.graph.nodes
        if n.op == "placeholder" and _is_user_tensor(n)
        for dim, size in enumerate(n.meta["example_value"].shape)
        if size == seq_len
    )
    return SequenceAnalysis(seq_len, tuple(sites), sequence_inputs)


def _query_key(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    if flex.is_flex_attention(node):
        return flex.query_key(node)
    args = attention_args(node)
    return args["query"], args["key"]


def _is_user_tensor(node: fx.Node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
