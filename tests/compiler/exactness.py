"""`autosp check` for models built in tests: `autosp.compile` on P gloo ranks against single-process training of
the same model copy on the same batches (loss, every gradient, every parameter after AdamW steps), per step."""
from __future__ import annotations

import copy
import importlib
from typing import Any

import torch

import autosp
from autosp.harness.check import relative_error
from autosp.harness.launch import launch

TOLERANCE = 1e-4


def _loss(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


def _batch(vocab: int, batch_size: int, seq_len: int, step: int, ignore_fraction: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    labels = ids.clone()
    labels[torch.rand(batch_size, seq_len, generator=g) < ignore_fraction] = -100
    return {"input_ids": ids, "labels": labels}


def _rank(builder: str, options: dict, vocab: int, batch_size: int, seq_len: int, steps: int, ignore_fraction: float,
          compile_options: dict) -> dict[str, float]:
    module, name = builder.rsplit(".", 1)
    model = getattr(importlib.import_module(module), name)(**options)
    reference = copy.deepcopy(model)
    # replicated unless asked (the coverage is the SP pass's; the ZeRO stages have their own matrix), so the
    # parameters compare one to one with the reference's
    compiled = autosp.compile(model, backend="aot_eager", sac="off", **{"zero": 0, **compile_options})
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(steps):
        batch = _batch(vocab, batch_size, seq_len, step, ignore_fraction)
        torch.manual_seed(step)  # the same random stream for both sides (dropout)
        loss = _loss(compiled(**batch))
        loss.backward()
        torch.manual_seed(step)
        ref_loss = _loss(reference(**batch))
        ref_loss.backward()
        worst["loss"] = max(worst["loss"], relative_error(loss.detach(), ref_loss.detach()))
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            if r.grad is not None:
                worst["grad"] = max(worst["grad"], relative_error(p.grad, r.grad))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        for p, r in zip(model.parameters(), reference.parameters()):
            worst["param"] = max(worst["param"], relative_error(p.detach(), r.detach()))
    return worst


def assert_exact(world_size: int, *, builder: str = "tests.compiler.models.build_decoder", vocab: int = 64,
                 batch_size: int = 1, seq_len: int = 64, steps: int = 2, ignore_fraction: float = 0.2,
                 compile_options: dict | None = None, **options) -> dict[str, float]:
    """Fail unless `builder(**options)` compiled by AutoSP on `world_size` ranks trains exactly as one process."""
    outcome = launch(_rank, (builder, options, vocab, batch_size, seq_len, steps, ignore_fraction,
                             compile_options or {}), world_size=world_size, timeout_s=400)
    assert outcome.status == "ok", f"{outcome.error}\n{outcome.output_tail}"
    worst = outcome.results[0]
    assert max(worst.values()) <= TOLERANCE, worst
    return worst
