"""Pass 1, sequence parallelism: the walk over Dynamo's Torch-IR graph of one rank that shards the sequence, resizes
views, keeps index tensors whole, reduces the loss over the group, and routes attention through `attention/`."""
