"""What the compiled graphs save for backward and hold at their peak, by operator category (attention, mlp, norm,
other), read from the partition records: each value the forward graph hands to backward is classified by the op
that produced it (attention kernels and the collectives around them are attention) or else by the module it came
from (Dynamo's ``nn_module_stack``). Bytes count each storage once (parameters excluded). The AutoSP method
reports these per run; `autosp.experiments.activations` tabulates them beside the eager methods' breakdown.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from autosp.compiler.fx import is_attention_value, is_collective_value, model_module, node_nbytes
from autosp.compiler.memory.records import PartitionRecord

CATEGORIES = ("attention", "mlp", "norm", "other")
UNATTRIBUTED = "unattributed"  # a saved tensor seen while no module of the model was running

# Checked per module-path segment, innermost first; norm before attention ("post_attention_layernorm").
_SEGMENT_RULES = (
    ("norm", re.compile(r"norm|^ln(_?\d+|_f)?$", re.IGNORECASE)),
    ("attention", re.compile(r"attn|attention", re.IGNORECASE)),
    ("mlp", re.compile(r"mlp|feed_?forward|ffn|experts?$", re.IGNORECASE)),
)
_SEGMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+")


def category_of_module(path: str | None, cls: type | str | None = None) -> str:
    """Category of the code running inside module ``path`` (e.g. ``model.layers.0.self_attn.q_proj`` ->
    attention): the innermost path segment or class name that names a category."""
    names = [getattr(cls, "__name__", cls)] if cls is not None else []
    names += reversed(_SEGMENT.findall(path or ""))
    for name in names:
        for category, rule in _SEGMENT_RULES:
            if isinstance(name, str) and rule.search(name):
                return category
    return "other"


def category_of_node(node: fx.Node, _depth: int = 0) -> str:
    """Category of a forward-graph value: attention kernels and collectives are attention, otherwise the
    module it was traced in; values without module metadata (inserted by a pass) take their inputs'."""
    if is_attention_value(node) or is_collective_value(node):
        return "attention"
    module = model_module(node)
    if module is not None:
        return category_of_module(str(module[0]), module[1])
    if _depth < 8:
        for parent in node.all_input_nodes:
            if parent.op != "placeholder":
                return category_of_node(parent, _depth + 1)
    return "other"


def graph_saved_bytes_by_category(record: PartitionRecord) -> dict[str, int]:
    """Bytes the forward graph of one partition saves for backward, per category (graph inputs excluded)."""
    out = dict.fromkeys(CATEGORIES, 0)
    for node in record.saved:
        if node.op != "placeholder":
            out[category_of_node(node)] += node_nbytes(node)
    return out


def compiled_breakdown(records: Iterable[PartitionRecord]) -> dict[str, int]:
    """Saved-activation bytes per category summed over every compiled graph (one per graph break)."""
    total = dict.fromkeys(CATEGORIES, 0)
    for record in records:
        for category, nbytes in graph_saved_bytes_by_category(record).items():
            total[category] += nbytes
    return total


def quadratic_saved_values(records: Iterable[PartitionRecord], seq_len: int) -> dict[str, int]:
    """The saved-for-backward values with two dims of the sequence length (O(S^2): a dense attention mask or
    scores), named `node shape dtype`, with their bytes: what still grows quadratically after the mask rewrite."""
    found: dict[str, int] = {}
    for record in records:
        for node in record.saved:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and list(value.shape).count(seq_len) >= 2:
                found[f"{node.name} {tuple(value.shape)} {value.dtype}"] = node_nbytes(node)
    return found


def peak_working_set(records: Iterable[PartitionRecord]) -> dict[str, Any]:
    """What is alive at the estimated peak of each compiled graph's step (the liveness replay of
    ``autosp.compiler.memory.planner``), summed over graphs: ``saved`` (activations forward kept for backward) and
    ``working`` (values backward makes: recomputed forward values, activation gradients) by category,
    ``gradients`` (parameter gradients made so far), the peak, and which half of the step it falls in."""
    from autosp.compiler.memory.planner import backward_inputs, device_saved_storages, held_bytes, live_at_peak

    total: dict[str, Any] = {"saved": dict.fromkeys(CATEGORIES, 0), "working": dict.fromkeys(CATEGORIES, 0),
                             "gradients": 0, "scratch": 0, "peak_bytes": 0, "at": []}
    for record in records:
        fw, bw = record.fw_module, record.bw_module
        saved = {n.name: n for n in record.saved if n.op != "placeholder"}
        fw_peak, fw_alive = live_at_peak(fw, set())
        storages = device_saved_storages(fw, record.num_fwd_outputs)  # a saved view keeps its base's storage
        bw_peak, bw_alive = live_at_peak(bw, backward_inputs(fw, bw, record.num_fwd_outputs), storages)
        backward = bw_peak >= fw_peak
        (outputs,) = [n for n in (bw if backward else fw).graph.nodes if n.op == "output"]
        returned = {a for a in outputs.all_input_nodes}
        alive = bw_alive if backward else fw_alive
        held = {n: held_bytes(n, storages if backward else {}) for n in alive}
        total["scratch"] += max(bw_peak, fw_peak) - sum(held.values())  # inside the running op
        for node in alive:
            if node.name in saved:
                total["saved"][category_of_node(saved[node.name])] += held[node]
            elif backward and node in returned:
                total["gradients"] += node_nbytes(node)
            else:
                total["working"][category_of_node(node)] += node_nbytes(node)
        total["peak_bytes"] += max(bw_peak, fw_peak)
        total["at"].append("backward" if backward else "forward")
    return total


def tiles_of(reports: Iterable[Any]) -> list[dict[str, Any]]:
    """One row per tiled region (``autosp.compiler.tiling.loss.TilingReport``): what, tokens, tokens per tile, and for
    a loss the bytes of one tile's fp32 logits (alive inside the tiled op, invisible to the graph replay)."""
    rows: list[dict[str, Any]] = []
    for report in reports:
        rows += [{"tile": "loss", "tokens": t["tokens"], "tile_tokens": t["tile_tokens"],
                  "tile_logits_bytes": t["tile_tokens"] * t["vocab"] * 4} for t in report.tiled]
        rows += [{"tile": b["module"], "tokens": b["tokens"], "tile_tokens": b["tile_tokens"]}
                 for b in (*report.mlp, *report.recurrences)]
    return rows
