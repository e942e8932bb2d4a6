"""Rank body comparing one method with single-process training on the same model, seed and global batch:
loss, every parameter's gradient, every parameter after one AdamW step (fp32)."""
from __future__ import annotations

import torch

from autosp.config import DataConfig, RunConfig
from autosp.models import build_model, get_preset
from autosp.models.data import make_batch
from autosp.parallel import build_context
import baselines.fsdp  # noqa: F401  (registers the methods in spawned ranks)
import baselines.zero3  # noqa: F401
from baselines.base import get_strategy

TOL = 2e-5  # fp32: reordered reductions over a few hundred tokens, well below any real bug (~1e-2 and up)


def _relative_error(mine: torch.Tensor, ref: torch.Tensor) -> float:
    return float((mine - ref).norm() / ref.norm().clamp_min(1e-30))


def compare_with_single(rank: int, world: int, method: str, model_name: str, seq_len: int,
                        ignore_fraction: float = 0.0, batch_size: int = 1) -> None:
    strategy = get_strategy(method)
    cfg = RunConfig(method=method, model=model_name, seq_len=seq_len, world_size=world, batch_size=batch_size,
                    data=DataConfig(ignore_fraction=ignore_fraction))
    preset = get_preset(model_name)
    strategy.validate(cfg, preset.num_attention_heads, preset.num_key_value_heads)
    sp = cfg.sp_size or strategy.default_sp_size(world)
    ctx = build_context(sp, torch.device("cpu"))
    batch = make_batch(cfg.data, batch_size=ctx.dp_size * batch_size, seq_len=seq_len,
                       vocab_size=preset.vocab_size, seed=cfg.seed)

    reference = build_model(model_name, seed=cfg.seed)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=cfg.lr)
    ref_loss = reference(**batch.model_kwargs()).loss
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    ref_opt.step()
    ref_params = {n: p.detach().clone() for n, p in reference.named_parameters()}

    step = strategy.setup(build_model(model_name, seed=cfg.seed), ctx, cfg)
    loss = step.forward_backward(batch)
    grads = step.full_gradients()
    step.optimizer_step()
    params = step.full_parameters()

    errors = {"loss": _relative_error(loss.cpu(), ref_loss.detach())}
    assert grads.keys() == ref_grads.keys() and params.keys() == ref_params.keys()
    errors["grad"] = max(_relative_error(grads[n], ref_grads[n]) for n in ref_grads)
    errors["param"] = max(_relative_error(params[n], ref_params[n]) for n in ref_params)
    worst_grad = max(ref_grads, key=lambda n: _relative_error(grads[n], ref_grads[n]))
    assert all(e < TOL for e in errors.values()), f"rank {rank} {method}: {errors} (worst grad {worst_grad})"
