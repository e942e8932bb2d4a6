"""gpt-oss's sensitivity (docs/measurements/2026-12-02-hf-models.md): single process, how far apart do its second-step
gradients come out when the parameters after the first AdamW step differ by as much as the SP run's did (3.1e-5)?
`python -m tests.compiler.gpt_oss_sensitivity`."""
import copy

import torch

from tests.compiler.exactness import _batch
from tests.compiler.hf_models import build_hf

PARAMETER_DIFFERENCE = 3.1e-5  # the SP run's, after step 1 (tests/compiler/test_hf_attention.py)


def second_step_difference(seed: int) -> tuple[float, str]:
    torch.manual_seed(0)
    a = build_hf("gpt-oss")
    b = copy.deepcopy(a)
    vocab = a.config.vocab_size
    for model in (a, b):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-8)
        model(**_batch(vocab, 1, 31, 0, 0.2)).loss.backward()
        opt.step()
        opt.zero_grad()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in b.parameters():
            p.add_((torch.rand(p.shape, generator=g) * 2 - 1) * PARAMETER_DIFFERENCE)
    batch = _batch(vocab, 1, 31, 1, 0.2)
    for model in (a, b):
        model(**batch).loss.backward()
    return max(((pa.grad - pb.grad).abs().max().item(), name)
               for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True) if pa.grad is not None)


if __name__ == "__main__":
    for seed in (1, 2, 3):
        worst, name = second_step_difference(seed)
        print(f"perturbation seed {seed}: second-step worst gradient difference {worst:.2e} ({name})")
