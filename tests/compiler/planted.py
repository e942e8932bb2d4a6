"""A bug planted in the SP pass for the property suite to find (`test_properties`): an off-by-one in the shard
offset of rotary positions. Where a local activation meets a full floating-point index tensor (the rotary cos/sin
tables; `shard.localize_partners` narrows them to the activation's positions), every rank past the first takes
the rows one position too early, so its queries and keys are rotated by their neighbour's angle: the loss and
gradients are wrong and nothing raises. `plant` shifts every rank past the first (the simplest case shows it);
`plant_past_rank_1` only ranks 2 and up (only P=4 shows it: the search must find and shrink a larger case)."""
from __future__ import annotations

import dataclasses


def plant(first_rank: int = 1) -> None:
    """Patch `autosp.compiler.sp.shard.localize_partners` in this process (a rank: call before compiling): ranks
    from `first_rank` on take their rotary rows one position early."""
    from autosp.compiler.sp import indices, shard
    from autosp.compiler.sp.spec import ShardSpec

    correct = shard.localize_partners

    def off_by_one(ctx, node) -> None:
        local = next((n for n in node.all_input_nodes if ctx.is_local(n)), None)
        spec = ctx.specs.get(local)
        if isinstance(spec, ShardSpec) and not spec.merged and ctx.sp_rank >= first_rank and spec.start > 0:
            for inp in node.all_input_nodes:
                full = ctx.original.get(inp)
                if ctx.is_local(inp) or not indices.is_index_value(ctx, inp) or not full.is_floating_point():
                    continue
                dim = spec.dim - (ctx.current[local].dim() - full.dim())
                if 0 <= dim < full.dim() and full.shape[dim] == spec.full_extent:
                    shifted = dataclasses.replace(spec, dim=dim, start=spec.start - 1)
                    node.replace_input_with(inp, ctx.localize(inp, dim, shifted, before=node))
        correct(ctx, node)

    shard.localize_partners = off_by_one


def plant_past_rank_1() -> None:
    plant(first_rank=2)
