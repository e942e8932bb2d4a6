"""How far apart do single-process gradients of HF's Qwen3-Next come out when only the gated delta rule's chunk size
changes (mathematically the same kernel, another fp32 summation order)? The floor a sharded run's gradients are held
to in docs/measurements/2026-12-04-hybrids.md. `python -m tests.compiler.gdn_sensitivity`."""
import functools

import torch
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from autosp.harness.check import relative_error
from tests.compiler.exactness import _batch
from tests.compiler.hf_models import build_hf


def second_step_gradients(chunk_size: int) -> dict[str, torch.Tensor]:
    """Gradients of the second step (31 tokens, AdamW eps=1e-3 as in test_hf_hybrids) with this chunk size."""
    original = qwen3_next.torch_chunk_gated_delta_rule
    qwen3_next.torch_chunk_gated_delta_rule = functools.partial(original, chunk_size=chunk_size)
    try:
        model = build_hf("qwen3-next")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
        model(**_batch(64, 1, 31, 0, 0.2)).loss.backward()
        opt.step()
        opt.zero_grad()
        model(**_batch(64, 1, 31, 1, 0.2)).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        qwen3_next.torch_chunk_gated_delta_rule = original


if __name__ == "__main__":
    reference = second_step_gradients(64)
    for chunk in (16, 8):
        other = second_step_gradients(chunk)
        print(chunk, max((relative_error(other[n], reference[n]), n) for n in reference))
