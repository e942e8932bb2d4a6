"""The recurrences' declared scratch against what HF's torch kernels allocate (issue 45): each op's forward and
backward run on real tensors under the harness's CPU meter; its peak inside the op minus the op's outputs is the
kernel's scratch. The gated delta rule at Qwen3.5 tiny's shapes (4 value heads of 16, chunks of 64; Qwen3.5's kernel
and Kimi delta attention's), the SSD scan at the tests' Mamba2 shapes (8 heads of 16, 2 groups, state 16; Bamba's
kernel) at chunks of 8, 64 and 256, lightning attention (HF's block loop as the op) at MiniMax tiny's shapes (4 heads of
16) in blocks of 8, 64 and 256.
`python -m tests.experiments.recurrence_scratch_check <tokens per rank>...` (docs/measurements/2026-12-05-hybrids-2.md).
"""
import itertools
import sys

import torch
import transformers.models.bamba.modeling_bamba  # noqa: F401 - the kernels the ops run
import transformers.models.kimi_linear.modeling_kimi_linear  # noqa: F401
import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401

import autosp.compiler.sp.recurrence.delta_rule_op  # noqa: F401 - the ops
import autosp.compiler.sp.recurrence.lightning_op  # noqa: F401
import autosp.compiler.sp.recurrence.ssd_op  # noqa: F401
from autosp.comm.transients import declared_transient_bytes
from autosp.harness.measure import CpuAllocationMeter

#: kernel -> its decay's shape beyond [B, L, H] (a scalar per head; Kimi's per channel)
SSD_KERNEL = "transformers.models.bamba.modeling_bamba"
KERNELS = {"transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule": (),
           "transformers.models.kimi_linear.modeling_kimi_linear.chunk_kimi_delta_attention": (16,)}


def peak_inside(call, args) -> tuple[int, int]:
    """(the meter's peak inside `call(*args)`, the bytes of its outputs)."""
    meter = CpuAllocationMeter()
    with meter.session(), meter.measured_step():
        out = call(*args)
    outputs = sum(t.nbytes for t in (out if isinstance(out, (list, tuple)) else [out]) if t is not None)
    return meter.report().peak_bytes, outputs


def _report(label: str, call, args) -> None:
    peak, outputs = peak_inside(call, args)
    print(f"{label}: kernel scratch {peak - outputs:,} B, declared {declared_transient_bytes(call, args, {}):,} B")


if __name__ == "__main__":
    torch.set_num_threads(1)
    ops = torch.ops.autosp_sp
    for (kernel, channels), tokens, tile in itertools.product(KERNELS.items(), map(int, sys.argv[1:]), (0, 128)):
        q, k, v, grad = (torch.randn(1, tokens, 4, 16) for _ in range(4))
        g, beta = -torch.rand(1, tokens, 4, *channels), torch.rand(1, tokens, 4)
        for name, call, args in (("forward", ops.gated_delta_rule, (q, k, v, g, beta, 64, True, kernel, tile)),
                                 ("backward", ops.gated_delta_rule_backward,
                                  (grad, None, q, k, v, g, beta, None, 64, True, kernel, tile))):
            _report(f"{kernel.rsplit('.', 1)[1]}, {tokens} tokens, tiles of {tile or tokens}, {name}", call, args)
    for chunk, tokens, tile in itertools.product((8, 64, 256), map(int, sys.argv[1:]), (0, 512)):
        x, grad = torch.randn(1, tokens, 8, 16), torch.randn(1, tokens, 8, 16)
        dt, A, D, dt_bias = torch.randn(1, tokens, 8), -torch.rand(8), torch.randn(8), torch.randn(8)
        B, C = torch.randn(1, tokens, 2, 16), torch.randn(1, tokens, 2, 16)
        inputs = (x, dt, A, B, C, D, dt_bias, chunk, True, 0.0, float("inf"), SSD_KERNEL, tile)
        label = f"ssd_scan, {tokens} tokens, chunks of {chunk}, tiles of {tile or tokens}"
        _report(f"{label}, forward", ops.ssd_scan, inputs)
        _report(f"{label}, backward", ops.ssd_scan_backward, (grad, None, *inputs))
    for block, tokens, tile in itertools.product((8, 64, 256), map(int, sys.argv[1:]), (0, 512)):
        q, k, v, grad = (torch.randn(1, 4, tokens, 16) for _ in range(4))
        inputs = (q, k, v, torch.rand(4, 1, 1) / 4, block, tile)
        label = f"lightning_attention, {tokens} tokens, blocks of {block}, tiles of {tile or tokens}"
        _report(f"{label}, forward", ops.lightning_attention, inputs)
        _report(f"{label}, backward", ops.lightning_attention_backward, (grad, None, *inputs))
