"""Causal sequence mixing other than attention, part of the `sp` stage: short causal convolutions with a halo from
the previous rank (`conv`); linear recurrences with each shard's incoming state passed along the ranks (`states`;
`shards`: the input check and output correction their rewrites share): the gated delta rule and Kimi delta attention
(`delta_rule`), Mamba2's SSD scan (`ssd`) and Mamba1's selective scan (`selective_scan`), each HF kernel traced as
custom ops (`*_op`, through `kernels`), and MiniMax's lightning attention (`lightning`: HF's inline block loop traced
as an op, `lightning_op`); and the refusal, naming the kernel, of the recurrences not yet sharded (`unsharded`). The
walk and the analysis use these modules directly."""
