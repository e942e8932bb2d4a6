"""The state entering each rank's shard of a linear recurrence, passed along the ranks.

A recurrence whose state update is affine in the state maps a shard's incoming state S_in to T(S_in) + U, where U is
the shard's final state from a zero state and T its transition (a matrix for the gated delta rule, a per-head decay
for Mamba2/SSD). The state entering rank r is the composition of the earlier ranks' pairs in rank order; it arrives
in P-1 rounds of `from_previous_rank`: in round j each rank sends T(S_recv) + U, its shard's final state given what it
received (rank 0 receives zeros), so after the last round rank r holds its S_in. Every rank takes part in every round,
so forward and backward (`to_previous_rank`) run the same exchanges on every rank.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from autosp.comm.library import op
from autosp.compiler.sp.spec import SPContext


def incoming_state(ctx: SPContext, before: fx.Node, own: fx.Node,
                   transition: Callable[[fx.Node], fx.Node]) -> fx.Node:
    """The state entering this rank's shard (zeros on rank 0), emitted before `before`: `own` is the shard's final
    state from a zero state (U), `transition(S)` emits the shard's transition applied to S (T(S))."""
    sent = own
    incoming = None
    for round_ in range(ctx.sp_size - 1):
        incoming = ctx.emit(before, op("from_previous_rank").default, (sent, ctx.sp_size, ctx.group_name))
        if round_ < ctx.sp_size - 2:
            sent = ctx.emit(before, torch.add, (transition(incoming), own))
    assert incoming is not None, "a recurrence is sharded over two ranks or more"
    return incoming

