"""Causal sequence mixing other than attention, part of the `sp` stage: short causal convolutions with a halo from
the previous rank (`conv`), the gated delta rule with each shard's incoming state passed along the ranks
(`delta_rule`, its kernel as custom ops: `delta_rule_op`), and the refusal, naming the kernel, of the recurrences
not yet sharded (`unsharded`). The walk uses these modules directly."""
