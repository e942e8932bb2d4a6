"""Sequence lengths not divisible by the SP degree: shards of L = ceil(S/P) positions, the last ones padded.

Rank r holds global positions [r*L, (r+1)*L); positions >= S exist only inside the shards, never in the user's
tensors, and are made inert so training stays the single-device computation on S tokens:
* a rank's slice of a full index tensor is its real positions, padded: token ids and positions with 0, loss
  targets with the loss's `ignore_index` (a padded position never counts as a label);
* attention sees S' = L*P positions: no real query may see a padded key (causal attention already hides keys
  after the last real token; an explicit mask gets its padded key columns masked, and a mask is added for
  unmasked non-causal attention), and padded queries see every key so their softmax stays finite;
* sums and means over the sequence keep only the real positions, and outputs are cut back to them.
A padded position's output reaches neither the loss nor a real position, so it gets exactly zero gradient.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autosp.compiler.sp.spec import ShardSpec, SPContext, node_label
from autosp.errors import SequenceParallelError


def shard_length(seq_len: int, sp_size: int) -> int:
    return -(-seq_len // sp_size)


def padded_length(seq_len: int, sp_size: int) -> int:
    return shard_length(seq_len, sp_size) * sp_size


def real_part(ctx: SPContext, local: fx.Node, before: fx.Node) -> fx.Node:
    """The positions of a local value that lie inside the sequence (the value itself when none is padding)."""
    spec = ctx.spec(local)
    amount = spec.padding
    if not amount:
        return local
    keep = max(0, spec.length - amount)
    real = ShardSpec(spec.dim, spec.global_len, min(spec.start, spec.global_len), keep, spec.outer, spec.inner)
    node = local
    if spec.merged:
        node = ctx.emit(before, "unflatten", (node, spec.dim, (spec.outer, spec.length, spec.inner)))
        node = ctx.emit(before, "narrow", (node, spec.dim + 1, 0, keep))
        return ctx.emit(before, "flatten", (node, spec.dim, spec.dim + 2), spec=real)
    return ctx.emit(before, "narrow", (local, spec.dim, 0, keep), spec=real)


def _is_bool(ctx: SPContext, node: fx.Node) -> bool:
    return ctx.current[node].dtype == torch.bool


def attention_mask(ctx: SPContext, mask: fx.Node | None, is_causal: bool, before: fx.Node) -> fx.Node | None:
    """The attention mask over the padded length S' (None when the original needs no change)."""
    seq_len, padded = ctx.seq_len, padded_length(ctx.seq_len, ctx.sp_size)
    amount = padded - seq_len
    if not amount or (mask is None and is_causal):
        return mask
    if mask is None:  # unmasked, non-causal: real queries see real keys only, padded queries see everything
        positions = ctx.emit(before, torch.arange, (padded,))
        real_key = ctx.emit(before, torch.lt, (positions, seq_len))
        padded_query = ctx.emit(before, torch.ge, (positions, seq_len))
        return ctx.emit(before, torch.logical_or, (ctx.emit(before, "unsqueeze", (real_key, 0)),
                                                   ctx.emit(before, "unsqueeze", (padded_query, 1))))
    hidden, visible = (False, True) if _is_bool(ctx, mask) else (float("-inf"), 0.0)
    shape = ctx.current[mask].shape
    if shape[-1] != seq_len:
        raise SequenceParallelError(
            f"attention {node_label(before)}: its mask of shape {tuple(shape)} broadcasts over the keys, so it cannot "
            f"hide the {amount} padding position(s); use a sequence length divisible by the SP degree {ctx.sp_size}")
    mask = ctx.pad(mask, -1, amount, hidden, before)
    if shape[-2] == seq_len:
        mask = ctx.pad(mask, -2, amount, visible, before)
    return mask


def hide_padding_keys(ctx: SPContext, softmax: fx.Node) -> None:
    """Hand-written attention: before its softmax (or a sink gate's logsumexp) over [.., S', S' + k] scores (k extra
    columns after the keys: sinks), real queries lose the padded keys and padded queries see uniform scores
    (whatever the model's own mask made of the padded rows and columns)."""
    padded = padded_length(ctx.seq_len, ctx.sp_size)
    if padded == ctx.seq_len:
        return
    scores = softmax.args[0]
    positions = ctx.emit(softmax, torch.arange, (padded,))
    is_pad = ctx.emit(softmax, torch.ge, (positions, ctx.seq_len))
    pad_row = ctx.emit(softmax, "unsqueeze", (is_pad, 1))
    columns = ctx.current[scores].shape[-1]
    pad_key = is_pad if columns == padded else ctx.pad(is_pad, -1, columns - padded, False, softmax)
    hidden = ctx.emit(softmax, torch.logical_and, (ctx.emit(softmax, "unsqueeze", (pad_key, 0)),
                                                   ctx.emit(softmax, torch.logical_not, (pad_row,))))
    masked = ctx.emit(softmax, "masked_fill", (scores, hidden, float("-inf")))
    softmax.replace_input_with(scores, ctx.emit(softmax, "masked_fill", (masked, pad_row, 0.0)))


def trim_outputs(ctx: SPContext, output: fx.Node) -> None:
    """Outputs along the sequence come back without padded positions."""
    def trim(node: fx.Node) -> fx.Node:
        if ctx.is_local(node) and isinstance(ctx.specs[node], ShardSpec) and ctx.spec(node).padding:
            return real_part(ctx, node, before=output)
        return node

    output.args = fx.node.map_arg(output.args, trim)
