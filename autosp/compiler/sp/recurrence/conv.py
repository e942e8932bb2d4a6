"""Short causal convolutions along the sharded sequence (the depthwise conv1d in front of Mamba, gated delta-net and
LFM2 layers), each rank on its shard with a halo of the previous rank's last `(k-1)*dilation` positions.

Recognised by what they compute, not by module: a `conv1d` whose input carries the sequence in its last dim, with
stride 1, padding `(k-1)*dilation` on both sides, and every use of its output the crop `[..., :S]` (so only the
left padding is ever read: output t sees inputs t-(k-1)*dilation..t). Rewritten as the convolution, without padding,
of `cat(halo, shard)`, the halo `from_previous_rank` of the shard's tail (zeros on rank 0: the left padding), whose
gradient goes back to the previous rank. Any other convolution along the sequence is refused in one line.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autosp.comm.library import op
from autosp.compiler.sp.spec import ShardSpec, SPContext, canonical_spec, node_label
from autosp.errors import SequenceParallelError

CONVOLUTIONS = {torch.conv1d, torch.nn.functional.conv1d, torch.conv2d, torch.nn.functional.conv2d}
_CONV1D_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def is_sequence_convolution(ctx: SPContext, node: fx.Node) -> bool:
    """A convolution whose spatial dims include the sharded sequence."""
    if node.target not in CONVOLUTIONS or not ctx.is_local(node.args[0]):
        return False
    spec = ctx.specs[node.args[0]]
    return isinstance(spec, ShardSpec) and spec.dim >= 2


def rewrite(ctx: SPContext, node: fx.Node) -> None:
    """Make the causal convolution `node` run on this rank's shard with its halo (module docstring)."""
    args = _bound(node)
    source, spec = args["input"], ctx.spec(node.args[0])
    kernel = ctx.current[args["weight"]].shape[-1] if isinstance(args["weight"], fx.Node) else None
    why = _not_causal(ctx, node, args, spec, kernel)
    if why:
        raise SequenceParallelError(
            f"{node_label(node)} convolves along the sharded sequence {why}: AutoSP shards causal convolutions "
            "(padding (k-1)*dilation, output cropped to the sequence) and softmax attention; train this model without "
            "sequence parallelism")
    halo = (kernel - 1) * _single(args["dilation"])
    if halo > spec.length:
        raise SequenceParallelError(
            f"{node_label(node)}: a causal convolution needs {halo} positions before each shard but a shard holds "
            f"{spec.length}; use fewer ranks or a longer sequence")
    if halo:
        tail = ctx.emit(node, "narrow", (source, -1, spec.length - halo, halo))
        previous = ctx.emit(node, op("from_previous_rank").default, (tail, ctx.sp_size, ctx.group_name))
        source = ctx.emit(node, torch.cat, ([previous, source], -1))
    node.args = (source, args["weight"], args["bias"], args["stride"], 0, args["dilation"], args["groups"])
    node.kwargs = {}
    node.meta["example_value"] = ctx.current[node] = ctx.run(node)
    ctx.specs[node] = spec
    for user in list(node.users):  # the crop to the sequence keeps the whole shard (its padding too, on a padded shard)
        _keep_whole(user, spec.length)


def _bound(node: fx.Node) -> dict:
    args = dict(zip(_CONV1D_ARGS, node.args, strict=False))
    args.update(node.kwargs)
    return {**_DEFAULTS, **args}


def _single(value: int | tuple | list) -> int:
    return value if isinstance(value, int) else value[0]


def _not_causal(ctx: SPContext, node: fx.Node, args: dict, spec: ShardSpec, kernel: int | None) -> str | None:
    """Why `node` is not a causal 1-D convolution over an evenly sharded sequence (None when it is)."""
    if node.target not in (torch.conv1d, torch.nn.functional.conv1d) or ctx.current[node.args[0]].dim() != 3:
        return "in more than one dimension"
    if spec.merged or spec.dim != 2 or spec != canonical_spec(2, spec.global_len, ctx.sp_rank, ctx.sp_size):
        return "on a sequence dimension sliced or merged with another"
    padding, stride, dilation = args["padding"], args["stride"], _single(args["dilation"])
    if isinstance(padding, str) or kernel is None or _single(stride) != 1:
        return f"with padding {padding!r}, stride {stride}"
    if _single(padding) != (kernel - 1) * dilation:
        return f"with padding {_single(padding)} for kernel {kernel} (not causal: a causal one pads (k-1)*dilation)"
    if not node.users or not all(_is_crop(user, spec.global_len) for user in node.users):
        return "without cropping its output to the sequence (it reads the right padding: not causal)"
    return None


def _keep_whole(crop: fx.Node, length: int) -> None:
    if crop.target is operator.getitem:
        index = crop.args[1] if isinstance(crop.args[1], tuple) else (crop.args[1],)
        crop.args = (crop.args[0], (*index[:-1], slice(None)))
    else:
        crop.args = (*crop.args[:3], length)


def _is_crop(user: fx.Node, seq_len: int) -> bool:
    """`out[..., :S]` or `out[:, :, :S]` (or `narrow(out, -1, 0, S)`): the causal part of a padded convolution."""
    if user.target is operator.getitem:
        index = user.args[1] if isinstance(user.args[1], tuple) else (user.args[1],)
        last = index[-1]
        rest = index[:-1]
        return (isinstance(last, slice) and last.start in (None, 0) and last.stop == seq_len and last.step in (None, 1)
                and all(i is Ellipsis or i == slice(None) for i in rest)
                and (Ellipsis in rest or len(index) == 3))
    if user.target in (torch.narrow, "narrow"):
        return user.args[1] in (-1, 2) and user.args[2] == 0 and user.args[3] == seq_len
    return False

