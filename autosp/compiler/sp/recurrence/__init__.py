"""Causal sequence mixing other than attention, part of the `sp` stage: short causal convolutions with a halo from
the previous rank (`conv`) and linear recurrences whose shards exchange (transition, final state) pairs (`delta_rule`),
and the refusal of every other scan along the sharded sequence (`scans`). The walk uses these modules directly."""
