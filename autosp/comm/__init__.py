"""Collectives as torch.library custom ops: opaque to Dynamo, traceable by aot_autograd, compiled by inductor."""
from autosp.comm.neighbours import from_previous_rank, to_previous_rank
from autosp.comm.ops import all_gather_shard, all_reduce_sum, all_to_all, reduce_scatter_sum
from autosp.comm.ring_attention import ring_attention_op

__all__ = ["all_gather_shard", "all_reduce_sum", "all_to_all", "from_previous_rank", "reduce_scatter_sum",
           "ring_attention_op", "to_previous_rank"]
