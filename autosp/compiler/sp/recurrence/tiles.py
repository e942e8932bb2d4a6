"""The recurrences over tiles of a rank's tokens (the `recurrence` part of the tiling option): each gated delta rule's
and SSD scan's `tile_tokens` set, so HF's kernel holds one tile's intermediates, not the whole shard's (at 32K tokens a
rank, a Qwen3.5-shaped 8B layer's backward held ~16 GB of them). Exact: the state carried from tile to tile is the
one the SP rewrite exchanges between ranks; backward pays one more forward sweep (the states entering the tiles)."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from autosp.comm.library import op
from autosp.comm.transients import declared_transient_bytes
from autosp.compiler.fx import dynamo_value
from autosp.compiler.sp.recurrence.kernels import nbytes

#: fewest chunks per tile: each tile is one call of HF's kernel, whose chunk loop should outweigh the call
MIN_CHUNKS_PER_TILE = 4

#: the ops that run their kernel in tiles (their last argument, `tile_tokens`) -> where their chunk size is
CHUNK_ARGUMENT = {"gated_delta_rule": 5, "gated_delta_rule_from": 6, "ssd_scan": 7, "ssd_scan_with_state": 7}


def _chunk_argument(node: fx.Node) -> int | None:
    if node.op != "call_function":
        return None
    return next((at for name, at in CHUNK_ARGUMENT.items() if node.target in (op(name), op(name).default)), None)


def auto_tile_tokens(target: Any, args: tuple, chunk_size: int) -> int:
    """Tokens per tile for `target(*args)` (fake values, untiled): the tile's intermediates no larger than the op's
    tensor inputs (which the step holds anyway), at least MIN_CHUNKS_PER_TILE chunks."""
    held = nbytes(*[x for x in args if isinstance(x, torch.Tensor)])
    rows = math.floor(args[0].shape[1] * held / declared_transient_bytes(target, args, {}))
    return max(MIN_CHUNKS_PER_TILE * chunk_size, rows // chunk_size * chunk_size)


def tile_recurrences(gm: fx.GraphModule, tile_tokens: int | None) -> list[dict[str, Any]]:
    """Set every tileable recurrence's tile in `gm` (in place) where its tokens exceed one tile (`tile_tokens`, or
    `auto_tile_tokens`); one row per tiled op: module, tokens, tokens per tile."""
    rows = []
    for node in gm.graph.nodes:
        at = _chunk_argument(node)
        if at is None:
            continue
        args = tuple(dynamo_value(x) if isinstance(x, fx.Node) else x for x in node.args)
        chunk_size, length = node.args[at], args[0].shape[1]
        tile = -(-tile_tokens // chunk_size) * chunk_size if tile_tokens else auto_tile_tokens(node.target, args,
                                                                                               chunk_size)
        if tile >= length:
            continue
        node.args = (*node.args[:-1], tile)
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        rows.append({"module": str(stack[-1][0]) if stack else node.name, "tokens": int(length),
                     "tile_tokens": int(tile)})
    if rows:
        gm.recompile()
    return rows
