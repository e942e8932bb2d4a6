"""The gated delta rule's declared scratch against what HF's torch kernel allocates (issue 45): Qwen3.5 tiny's shapes
(4 value heads of 16, chunks of 64), the op's forward and backward run on real tensors under the harness's CPU meter;
its peak inside the op minus the op's outputs is the kernel's scratch.
`python -m tests.experiments.recurrence_scratch_check <tokens per rank>...` (docs/measurements/2026-12-05-hybrids-2.md).
"""
import sys

import torch
import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401 - the kernel the op runs

import autosp.compiler.sp.recurrence.delta_rule_op  # noqa: F401 - the ops
from autosp.comm.transients import declared_transient_bytes
from autosp.harness.measure import CpuAllocationMeter

KERNEL = "transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule"


def _peak(call, args) -> tuple[int, int]:
    """(the meter's peak inside `call(*args)`, the bytes of its outputs)."""
    meter = CpuAllocationMeter()
    with meter.session(), meter.measured_step():
        out = call(*args)
    outputs = sum(t.nbytes for t in (out if isinstance(out, (list, tuple)) else [out]) if t is not None)
    return meter.report().peak_bytes, outputs


if __name__ == "__main__":
    torch.set_num_threads(1)
    ops = torch.ops.autosp_sp
    for tokens in map(int, sys.argv[1:]):
        q, k, v, grad = (torch.randn(1, tokens, 4, 16) for _ in range(4))
        g, beta = -torch.rand(1, tokens, 4), torch.rand(1, tokens, 4)
        for name, call, args in (("forward", ops.gated_delta_rule, (q, k, v, g, beta, 64, True, KERNEL)),
                                 ("backward", ops.gated_delta_rule_backward,
                                  (grad, None, q, k, v, g, beta, None, 64, True, KERNEL))):
            peak, outputs = _peak(call, args)
            print(f"{tokens} tokens, {name}: kernel scratch {peak - outputs:,} B, declared "
                  f"{declared_transient_bytes(call, args, {}):,} B")
