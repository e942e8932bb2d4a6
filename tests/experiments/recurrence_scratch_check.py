"""The gated delta rule's declared scratch against what HF's torch kernels allocate (issue 45): Qwen3.5 tiny's shapes
(4 value heads of 16, chunks of 64; Qwen3.5's kernel and Kimi delta attention's), the op's forward and backward run
on real tensors under the harness's CPU meter; its peak inside the op minus the op's outputs is the kernel's scratch.
`python -m tests.experiments.recurrence_scratch_check <tokens per rank>...` (docs/measurements/2026-12-05-hybrids-2.md).
"""
import itertools
import sys

import torch
import transformers.models.kimi_linear.modeling_kimi_linear  # noqa: F401 - the kernels the op runs
import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401

import autosp.compiler.sp.recurrence.delta_rule_op  # noqa: F401 - the ops
from autosp.comm.transients import declared_transient_bytes
from autosp.harness.measure import CpuAllocationMeter

#: kernel -> its decay's shape beyond [B, L, H] (a scalar per head; Kimi's per channel)
KERNELS = {"transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule": (),
           "transformers.models.kimi_linear.modeling_kimi_linear.chunk_kimi_delta_attention": (16,)}


def peak_inside(call, args) -> tuple[int, int]:
    """(the meter's peak inside `call(*args)`, the bytes of its outputs)."""
    meter = CpuAllocationMeter()
    with meter.session(), meter.measured_step():
        out = call(*args)
    outputs = sum(t.nbytes for t in (out if isinstance(out, (list, tuple)) else [out]) if t is not None)
    return meter.report().peak_bytes, outputs


if __name__ == "__main__":
    torch.set_num_threads(1)
    ops = torch.ops.autosp_sp
    for (kernel, channels), tokens in itertools.product(KERNELS.items(), map(int, sys.argv[1:])):
        q, k, v, grad = (torch.randn(1, tokens, 4, 16) for _ in range(4))
        g, beta = -torch.rand(1, tokens, 4, *channels), torch.rand(1, tokens, 4)
        for name, call, args in (("forward", ops.gated_delta_rule, (q, k, v, g, beta, 64, True, kernel)),
                                 ("backward", ops.gated_delta_rule_backward,
                                  (grad, None, q, k, v, g, beta, None, 64, True, kernel))):
            peak, outputs = peak_inside(call, args)
            print(f"{kernel.rsplit('.', 1)[1]}, {tokens} tokens, {name}: kernel scratch {peak - outputs:,} B, "
                  f"declared {declared_transient_bytes(call, args, {}):,} B")
