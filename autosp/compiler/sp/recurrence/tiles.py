"""The recurrences over tiles of a rank's tokens (the `recurrence` part of the tiling option): each gated delta rule's,
SSD scan's and lightning attention's `tile_tokens` set, so HF's kernel holds one tile's intermediates, not the whole
shard's (at 32K tokens a rank, a Qwen3.5-shaped 8B layer's backward held ~16 GB of them). Exact: the state carried
from tile to tile is the one the SP rewrite exchanges between ranks; backward pays one more forward sweep (the states
entering the tiles)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autosp.comm.library import op
from autosp.comm.transients import declared_transient_bytes, nbytes
from autosp.compiler.fx import dynamo_value

#: fewest chunks per tile: each tile is one call of HF's kernel, whose chunk loop should outweigh the call
MIN_CHUNKS_PER_TILE = 4


@dataclass(frozen=True)
class TiledOp:
    """An op that runs its kernel in tiles (its last argument, `tile_tokens`)."""

    chunk_at: int  # the position of its chunk (block) size argument
    dim: int  # its inputs' sequence dim
    backward: str  # its backward op, whose arguments are (grad_out, grad_state, *the op's)
    state_slot: bool = False  # the backward also takes an initial state the op has not (None after the op's tensors)

    def backward_args(self, args: tuple) -> tuple:
        """The backward's arguments for the op's `args` (the gradients None: no declared scratch reads them)."""
        if self.state_slot:
            return (None, None, *args[:self.chunk_at], None, *args[self.chunk_at:])
        return (None, None, *args)


TILED_OPS = {
    "gated_delta_rule": TiledOp(5, 1, "gated_delta_rule_backward", state_slot=True),
    "gated_delta_rule_from": TiledOp(6, 1, "gated_delta_rule_backward"),
    "ssd_scan": TiledOp(7, 1, "ssd_scan_backward"),
    "ssd_scan_with_state": TiledOp(7, 1, "ssd_scan_backward"),
    "lightning_attention": TiledOp(4, 2, "lightning_attention_backward"),
    "lightning_attention_with_state": TiledOp(4, 2, "lightning_attention_backward"),
}


def _tiled_op(node: fx.Node) -> str | None:
    """The name of the tileable op `node` calls, if it calls one."""
    if node.op != "call_function":
        return None
    return next((name for name in TILED_OPS if node.target in (op(name), op(name).default)), None)


def auto_tile_tokens(name: str, args: tuple) -> int:
    """Tokens per tile for op `name` on `args` (fake values, untiled): the tile's intermediates, forward's or
    backward's (the larger), no larger than the op's tensor inputs (which the step holds anyway), at least
    MIN_CHUNKS_PER_TILE chunks."""
    tiled = TILED_OPS[name]
    chunk_size = args[tiled.chunk_at]
    held = sum(nbytes(x) for x in args if isinstance(x, torch.Tensor))
    scratch = max(declared_transient_bytes(op(name), args, {}),
                  declared_transient_bytes(op(tiled.backward), tiled.backward_args(args), {}))
    rows = math.floor(args[0].shape[tiled.dim] * held / scratch)
    return max(MIN_CHUNKS_PER_TILE * chunk_size, rows // chunk_size * chunk_size)


def tile_recurrences(gm: fx.GraphModule, tile_tokens: int | None) -> list[dict[str, Any]]:
    """Set every tileable recurrence's tile in `gm` (in place) where its tokens exceed one tile (`tile_tokens`, or
    `auto_tile_tokens`); one row per tiled op: module, tokens, tokens per tile."""
    rows = []
    for node in gm.graph.nodes:
        name = _tiled_op(node)
        if name is None:
            continue
        args = tuple(dynamo_value(x) if isinstance(x, fx.Node) else x for x in node.args)
        chunk_size, length = node.args[TILED_OPS[name].chunk_at], args[0].shape[TILED_OPS[name].dim]
        tile = -(-tile_tokens // chunk_size) * chunk_size if tile_tokens else auto_tile_tokens(name, args)
        if tile >= length:
            continue
        node.args = (*node.args[:-1], tile)
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        rows.append({"module": str(stack[-1][0]) if stack else node.name, "tokens": int(length),
                     "tile_tokens": int(tile)})
    if rows:
        gm.recompile()
    return rows
