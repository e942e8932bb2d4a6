"""The gated delta rule over tiles of a rank's tokens (the `recurrence` part of the tiling option): each op's
`tile_tokens` set, so HF's kernel holds one tile's intermediates, not the whole shard's (at 32K tokens a rank, a
Qwen3.5-shaped 8B layer's backward held ~11 GB of them). Exact: the state carried from tile to tile is the one the
SP rewrite exchanges between ranks; backward pays one more forward sweep (the states entering the tiles)."""
from __future__ import annotations

import math
from typing import Any

import torch.fx as fx

from autosp.comm.library import op
from autosp.compiler.fx import dynamo_value
from autosp.compiler.sp.recurrence.delta_rule_op import scratch_bytes

#: fewest chunks per tile: each tile is one call of HF's kernel, whose chunk loop should outweigh the call
MIN_CHUNKS_PER_TILE = 4


def _ops() -> tuple:
    return tuple(x for name in ("gated_delta_rule", "gated_delta_rule_from") for x in (op(name), op(name).default))


def auto_tile_tokens(inputs: list[Any], chunk_size: int) -> int:
    """Tokens per tile: the tile's intermediates no larger than the op's inputs (q, k, v, g, beta, which the step
    holds anyway), at least MIN_CHUNKS_PER_TILE chunks."""
    q, _, v, g, _ = inputs
    held = sum(x.numel() * x.element_size() for x in inputs)
    rows = math.floor(q.shape[1] * held / scratch_bytes(q, v, g, chunk_size, 0))
    return max(MIN_CHUNKS_PER_TILE * chunk_size, rows // chunk_size * chunk_size)


def tile_recurrences(gm: fx.GraphModule, tile_tokens: int | None) -> list[dict[str, Any]]:
    """Set every gated delta rule's tile in `gm` (in place) where its tokens exceed one tile (`tile_tokens`, or
    `auto_tile_tokens`); one row per tiled op: module, tokens, tokens per tile."""
    rows = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _ops():
            continue
        inputs = [dynamo_value(x) for x in node.args[:5]]
        chunk_size, length = node.args[-4], inputs[0].shape[1]
        tile = -(-tile_tokens // chunk_size) * chunk_size if tile_tokens else auto_tile_tokens(inputs, chunk_size)
        if tile >= length:
            continue
        node.args = (*node.args[:-1], tile)
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        rows.append({"module": str(stack[-1][0]) if stack else node.name, "tokens": int(length),
                     "tile_tokens": int(tile)})
    if rows:
        gm.recompile()
    return rows
