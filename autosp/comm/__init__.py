"""Collectives as torch.library custom ops: opaque to Dynamo, traceable by aot_autograd, compiled by inductor."""
from autosp.comm.ops import all_reduce_sum, all_to_all
from autosp.comm.ring_attention import ring_attention_op

__all__ = ["all_reduce_sum", "all_to_all", "ring_attention_op"]
