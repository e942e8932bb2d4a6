"""How far apart do single-process gradients of HF's gated delta-net models come out when only the gated delta rule's
chunk size changes (mathematically the same kernel, another fp32 summation order)? The floor a sharded run's
gradients are held to (docs/measurements/2026-12-04-hybrids.md, tests/compiler/test_hf_hybrids.py).
`python -m tests.compiler.gdn_sensitivity`."""
import functools
import importlib

import torch

from autosp.harness.check import relative_error
from tests.compiler.exactness import _batch
from tests.compiler.hf_models import build_hf

MODULES = {"qwen3-next": "transformers.models.qwen3_next.modeling_qwen3_next",
           "qwen3.5": "transformers.models.qwen3_5.modeling_qwen3_5"}


def gradients(family: str, seq_len: int, steps: int, chunk_size: int) -> dict[str, torch.Tensor]:
    """Gradients of step `steps` (AdamW eps=1e-3 as in test_hf_hybrids between steps) with this chunk size."""
    module = importlib.import_module(MODULES[family])
    original = module.torch_chunk_gated_delta_rule
    module.torch_chunk_gated_delta_rule = functools.partial(original, chunk_size=chunk_size)
    try:
        model = build_hf(family)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
        for step in range(steps):
            opt.zero_grad()
            model(**_batch(64, 1, seq_len, step, 0.2)).loss.backward()
            if step < steps - 1:
                opt.step()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        module.torch_chunk_gated_delta_rule = original


if __name__ == "__main__":
    for family, seq_len, steps, chunks in (("qwen3-next", 31, 2, (16, 8)), ("qwen3.5", 30, 1, (16, 8)),
                                           ("qwen3.5", 64, 1, (32,))):
        reference = gradients(family, seq_len, steps, 64)
        for chunk in chunks:
            other = gradients(family, seq_len, steps, chunk)
            print(family, seq_len, f"step {steps}", f"chunk {chunk}",
                  max((relative_error(other[n], reference[n]), n) for n in reference))
