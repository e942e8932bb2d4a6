"""The AutoSP compiler: the paper's SP pipeline over Dynamo's Torch-IR graph, one module per step.

analysis -> (shard, resize, communicate, indices, loss: applied in one walk by `sp.walk`) -> backend lowering.
"""
