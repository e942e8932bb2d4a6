"""The AutoSP compiler: Dynamo's graph of a model, one graph per sequence length, through the passes of `pipeline`.

The driver sits here: `options` (CompileOptions, validated once), `backend` (the torch.compile backend bound to the
process groups, per-length graphs through `specialize`, Dynamo's tracing settings from `tracing`), `pipeline` (the
passes in order, each with its contract) and `lowering` (Inductor or aot_eager, the partition function swapped in).
Each pass is a stage in a sub-package, which offers the rest only the names in its `__init__`:

  sp/       1  sequence parallelism: the walk that shards the sequence; attention/ (all-to-alls, hybrid, flex, masks)
  tiling/   2  the LM head + loss, token-wise blocks and RMSNorms over tiles of the local tokens
  zero/     3, 5  gradients reduced in buckets inside backward; parameter gathers issued a layer ahead
  memory/   4, 6  checkpointing policies, the partition function and memory planner, offload to host memory
  fx/       graph helpers every stage uses (node kinds, layers, fake values, SDPA arguments, byte sizes)

The stages import downwards only (driver > sp, tiling, memory, zero > fx; pyproject.toml's import-linter contracts).
"""
