"""Hybrid Ulysses x Ring (USP): SP degrees beyond what the attention heads allow.

Ulysses splits heads, so it needs the query heads (and KV heads after replication) to divide the SP degree P.
The hybrid runs Ulysses inside groups of u consecutive ranks (u divides the heads; consecutive ranks share a node,
where all-to-all is cheap) and ring attention across the R = P/u groups: after the group's all-to-all a rank holds
H/u heads of its group's contiguous block of S/R positions, and K/V blocks travel around the ring of the ranks
that hold the same heads in the other groups (`autosp.comm.ring_attention`: the exact PyTorch ring on CPU,
ring-flash-attn on CUDA). Shards stay the plain ranges [r*L, (r+1)*L) of pure Ulysses, so every other step of the
pass is unchanged. u is the largest size the heads, the SP degree and the node allow, or the caller's choice.
"""
from __future__ import annotations

import math
import operator
import os

import torch.distributed as dist
import torch.fx as fx

from autosp.comm.library import op
from autosp.compiler.sp.spec import SPContext, node_label
from autosp.errors import SequenceParallelError

RING = op("ring_attention").default
_SUBGROUPS: dict[tuple[str, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def _fits(site, u: int) -> bool:
    """u splits this attention's query heads, and its KV heads (replicated just enough, see `communicate`)."""
    if site.heads % u:
        return False
    return site.kv_heads % u == 0 or site.heads % (site.kv_heads * (u // math.gcd(site.kv_heads, u))) == 0


def node_size(sp_size: int) -> int:
    """Ranks per node (LOCAL_WORLD_SIZE from torchrun/SLURM launchers; one node when unknown)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or sp_size


def choose_ulysses_size(sites, sp_size: int, requested: int | None, eager: bool) -> int:
    """The Ulysses group size: `requested` if it is valid, else the largest valid one inside a node."""
    valid = [u for u in range(1, sp_size + 1) if sp_size % u == 0 and all(_fits(s, u) for s in sites)]
    if eager:  # hand-written and flex attention have no ring form: all heads must split over all ranks
        valid = [u for u in valid if u == sp_size]
        if not valid:
            site = sites[0]
            raise SequenceParallelError(
                f"attention {site.layer} is written by hand or flex_attention with {site.heads} query heads, not "
                f"divisible by the SP degree {sp_size}: it runs as Ulysses only (no ring form); use SDPA for a "
                "hybrid Ulysses x Ring, or an SP degree dividing the heads")
    if requested is not None:
        if requested not in valid:
            raise SequenceParallelError(
                f"ulysses_size={requested} must divide the SP degree {sp_size} and the query heads (KV heads after "
                f"replication) of every attention; valid here: {valid}")
        return requested
    in_node = [u for u in valid if u <= node_size(sp_size)]
    return max(in_node or valid[:1])


def subgroups(sp_group: dist.ProcessGroup, ulysses_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's Ulysses group: u consecutive SP ranks, its ring: the ranks at the same place in every group).

    Created when a graph first needs them, by the member ranks only (every rank creates its Ulysses group, then
    its ring, so no rank waits on a group another rank has not reached); cached per SP group and size."""
    key = (sp_group.group_name, ulysses_size)
    if key not in _SUBGROUPS:
        sp_rank, sp_size = dist.get_rank(sp_group), dist.get_world_size(sp_group)
        ranks = [dist.get_global_rank(sp_group, r) for r in range(sp_size)]
        first = sp_rank - sp_rank % ulysses_size
        ulysses = dist.new_group(ranks[first:first + ulysses_size], use_local_synchronization=True)
        ring = dist.new_group(ranks[sp_rank % ulysses_size::ulysses_size], use_local_synchronization=True)
        _SUBGROUPS[key] = (ulysses, ring)
    return _SUBGROUPS[key]


def replace_with_ring(ctx: SPContext, node: fx.Node, args: dict) -> None:
    """Turn SDPA (inputs already all-to-all'ed inside the Ulysses group) into ring attention across the groups."""
    label = node_label(node)
    if args["attn_mask"] is not None:
        raise SequenceParallelError(
            f"attention {label} has an explicit mask: the ring of the hybrid Ulysses x Ring (SP degree {ctx.sp_size}, "
            f"Ulysses groups of {ctx.a2a_size}) runs causal or unmasked attention only; use an SP degree dividing "
            "the heads, or is_causal=True")
    padded = ctx.seq_len % ctx.sp_size != 0
    if padded and not args["is_causal"]:
        raise SequenceParallelError(
            f"attention {label}: unmasked non-causal attention over a padded sequence would see the padding in the "
            f"ring; use a sequence length divisible by the SP degree {ctx.sp_size}")
    q = args["query"]
    scale = args["scale"] if args["scale"] is not None else 1.0 / math.sqrt(ctx.current[q].shape[-1])
    ring = ctx.emit(node, RING, (q, args["key"], args["value"], float(scale), bool(args["is_causal"]), ctx.ring_group))
    node.target, node.args, node.kwargs = operator.getitem, (ring, 0), {}
