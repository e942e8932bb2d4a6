"""How far apart do single-process gradients of HF's Mamba2-scan models come out when only the SSD scan's chunk size
changes (the same mathematics, another fp32 summation order)? Whether a sharded run has a floor like the gated delta
rule's (docs/measurements/2026-12-05-hybrids.md). `python -m tests.compiler.ssd_sensitivity [family] [tokens] [steps]`
(default nemotron-h 32 2: AdamW eps 1e-8 between steps, as in the exactness tests)."""
import sys

import torch

import tests.compiler.hf_models as models
from autosp.harness.check import relative_error
from tests.compiler.exactness import _batch


def gradients(family: str, seq_len: int, steps: int, chunk_size: int) -> dict[str, torch.Tensor]:
    """Gradients of step `steps` with the family's config at this chunk size."""
    model_class, config_class, overrides, keywords = models.FAMILIES[family]
    (key,) = [k for k in overrides if k.endswith("chunk_size")]
    models.FAMILIES["_chunked"] = (model_class, config_class, {**overrides, key: chunk_size}, keywords)
    try:
        model = models.build_hf("_chunked")
    finally:
        del models.FAMILIES["_chunked"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-8)
    for step in range(steps):
        opt.zero_grad()
        model(**_batch(64, 1, seq_len, step, 0.2)).loss.backward()
        if step < steps - 1:
            opt.step()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


if __name__ == "__main__":
    family, seq_len, steps = (sys.argv[1:] + ["nemotron-h", "32", "2"][len(sys.argv) - 1:])[:3]
    reference = gradients(family, int(seq_len), int(steps), 8)
    for chunk in (16, 4):
        other = gradients(family, int(seq_len), int(steps), chunk)
        print(family, seq_len, f"step {steps}", f"chunk {chunk} vs 8",
              max((relative_error(other[n], reference[n]), n) for n in reference))
