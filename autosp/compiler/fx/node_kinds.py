"""What a node of an aten graph is, for the checkpointing policies: attention, a collective, an opaque kernel, a
view, random or mutating; the project's own ops (`autosp.comm.library`) classified by name."""
from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from autosp.comm.library import op_name

aten = torch.ops.aten

_ATTENTION_OP_NAMES = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_attention_math_for_mps",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
ATTENTION_FORWARD_OPS: frozenset[Any] = frozenset(
    getattr(aten, name) for name in _ATTENTION_OP_NAMES if hasattr(aten, name)
)
"""OpOverloadPackets of every attention-forward kernel an SDPA call can lower to (varies by device/dtype); the
flex_attention HOP is attention too (`is_attention_forward`)."""

#: torch's namespaces whose every op communicates
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor"})
#: autosp's own custom ops (``torch.ops.autosp_sp.<name>``, `autosp.comm.library`) by what the policies may do with
#: them. Every op of the namespace is in at least one list (tests/compiler/test_sac.py), and a forward op in any of
#: them is never re-run in backward by `sac`/`budget` (``full`` recomputes attention that does not communicate):
#: collectives communicate (re-running one re-runs its communication; ZeRO-3's regather is the one exception, by
#: design); the ring's attention is both a collective and attention.
AUTOSP_COLLECTIVE_OPS = frozenset({"all_to_all", "all_reduce_sum", "all_gather_shard", "reduce_scatter_sum",
                                   "ring_attention", "ring_attention_backward", "from_previous_rank",
                                   "to_previous_rank", "all_gather_sequence", "reduce_scatter_sequence"})
#: attention kernels, treated as SDPA's (the op SAC exists to keep)
AUTOSP_ATTENTION_OPS = frozenset({"masked_attention", "ring_attention"})
#: other opaque kernels, pinned like the collectives: the tiled loss makes its gradients in forward, so re-running it
#: in backward would redo the whole tiled computation; masked attention's backward is a backward op; flex's block sums
#: (`flex_masks`) evaluate the mask S/128 times for a [B, H, S/128, S/128] result: kept, never re-run; the gated delta
#: rule's and Mamba's scans and lightning attention (`sp/recurrence`) are whole chunked recurrences, their backward
#: re-running them once
AUTOSP_OPAQUE_OPS = frozenset({"linear_cross_entropy", "masked_attention_backward", "flex_block_sums",
                               "gated_delta_rule", "gated_delta_rule_from", "gated_delta_rule_backward",
                               "ssd_scan", "ssd_scan_with_state", "ssd_scan_backward", "selective_scan",
                               "selective_scan_with_state", "selective_scan_backward", "lightning_attention",
                               "lightning_attention_with_state", "lightning_attention_backward"})
#: token-wise kernels, recomputed like the aten ops they replace (`autosp.compiler.tiling.norm`)
AUTOSP_TOKENWISE_OPS = frozenset({"rms_norm", "rms_norm_backward"})
#: the activation offload's copies (`autosp.compiler.memory`'s offload): inserted after partitioning, so no policy sees
#: them
AUTOSP_OFFLOAD_OPS = frozenset({"offload", "reload", "wait"})
#: the parameter offload's copies (`autosp.comm.host_params`): a parameter's fetch from host memory, re-run in backward
#: as ZeRO 3's regather is; its gradient's copy to host memory, made in backward only
AUTOSP_HOST_PARAM_OPS = frozenset({"fetch_parameter", "gradient_to_host"})


#: the partitioner's RNG wrappers of a recomputed random op (attention has a dropout), by where the op's own
#: arguments start: run_and_save_rng_state(op, ...) in forward, run_with_rng_state(state, op, ...) in backward
RNG_WRAPPERS = {"run_and_save_rng_state": 1, "run_with_rng_state": 2}


def unwrap_rng(target: Any, args: Sequence[Any]) -> tuple[Any, tuple]:
    """The op an RNG wrapper runs and the op's arguments; `target` and `args` as they are otherwise."""
    start = RNG_WRAPPERS.get(getattr(target, "__name__", ""))
    if start is None or len(args) < start:
        return target, tuple(args)
    return args[start - 1], tuple(args[start:])


def _packet(node: fx.Node) -> Any:
    """The op's OpOverloadPacket, looking through the partitioner's RNG wrappers (`unwrap_rng`)."""
    return getattr(unwrap_rng(node.target, node.args)[0], "overloadpacket", None)


def autosp_op_name(node: fx.Node) -> str | None:
    """`name` of a call to one of the project's ops (``autosp_sp::<name>``, through the RNG wrappers), else None."""
    return op_name(_packet(node)) if node.op == "call_function" else None


def is_attention_forward(node: fx.Node) -> bool:
    return node.op == "call_function" and (_packet(node) in ATTENTION_FORWARD_OPS
                                           or autosp_op_name(node) in AUTOSP_ATTENTION_OPS
                                           or node.target is torch.ops.higher_order.flex_attention)


def is_collective(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if (getattr(node.target, "namespace", None) in COLLECTIVE_NAMESPACES
            or autosp_op_name(node) in AUTOSP_COLLECTIVE_OPS):
        return True
    return "all_to_all" in str(node.target) or "alltoall" in str(node.target)


def is_opaque(node: fx.Node) -> bool:
    """One of autosp's opaque kernels (`AUTOSP_OPAQUE_OPS`): neither attention nor a collective."""
    return autosp_op_name(node) in AUTOSP_OPAQUE_OPS


def getitem_source(node: fx.Node) -> fx.Node | None:
    """The multi-output node a `getitem` reads one output of, else None."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def is_attention_value(node: fx.Node) -> bool:
    """The attention op itself or one of its outputs (out, logsumexp, ...)."""
    parent = getitem_source(node)
    return is_attention_forward(node) or (parent is not None and is_attention_forward(parent))


def is_collective_value(node: fx.Node) -> bool:
    parent = getitem_source(node)
    return is_collective(node) or (parent is not None and is_collective(parent))


def is_pinned_value(node: fx.Node) -> bool:
    """A collective or opaque kernel, or one of its outputs: saved under every policy, never re-run."""
    parent = getitem_source(node)
    return is_collective_value(node) or is_opaque(node) or (parent is not None and is_opaque(parent))


def _dropout_p(node: fx.Node) -> float:
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return float(value or 0.0)
    return 0.0


def is_random(node: fx.Node) -> bool:
    """Seeded random ops are left to the partitioner; attention kernels carry the tag for their dropout,
    so they count as random only with a non-zero dropout_p."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    return not is_attention_forward(node) or _dropout_p(node) != 0.0


def is_mutating(node: fx.Node) -> bool:
    """An op whose schema writes to an argument."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def is_view(node: fx.Node) -> bool:
    """An op whose output aliases its first argument without writing to it (a view: saving it pins its base)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(
        a.alias_info is not None and not a.alias_info.is_write for a in schema.arguments[:1]
    ) and any(r.alias_info is not None for r in schema.returns)


def holds_tensors(node: fx.Node) -> bool:
    """A node whose value is a tensor, or a tuple/list holding at least one."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) or (
        isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)
    )
