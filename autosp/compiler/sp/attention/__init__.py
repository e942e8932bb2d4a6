"""Attention under sequence parallelism, part of the `sp` stage (the walk and `analysis` use these modules directly):
the all-to-alls around it and head chunks (`communicate`), the hybrid with ring attention (`hybrid`), hand-written
attention found by shape (`eager_attention`), flex attention and its block masks by rows (`flex`, `flex_masks`),
masks proved causal or run as O(S) programs (`masks`, `masked_attention`). What the rest of the compiler uses is
offered by `autosp.compiler.sp`."""
