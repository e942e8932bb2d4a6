"""`ds-autosp`: DeepSpeed's own AutoSP, run as its documentation says, as a peer to measure against.

Setup: `deepspeed.initialize` with `{"zero_optimization": {"stage": 0}, "compile": {"deepcompile": true,
"passes": ["autosp"]}, "sequence_parallel_size": P}` (AutoSP composes with ZeRO 0/1 only; with 2/3 DeepSpeed
silently falls back to plain torch.compile; mixed bf16 runs stage 1, DeepSpeed's BF16 optimizer with fp32
masters), then `engine.compile()` — its AutoSP backend shards the traced graph, inserts its all-to-alls and its
long-context checkpointing, and always compiles with inductor.
Each step: this dp rank's rows of the *full* sequence go through `prepare_autosp_inputs(input_ids, labels,
position_ids, attention_mask)` (position_ids = arange when the data has none, as DeepSpeed's example does) and
into the engine; the model computes its own loss (labels shifted inside, HF style); `engine.backward`,
`engine.step`. DeepSpeed reduces gradients over all ranks itself.

`hf:<preset>` models run with HF's default `use_cache=True` (the harness builds them with False): HF then calls
SDPA with `is_causal=True` and no mask, the only form DeepSpeed's pass can shard (with an explicit [B,1,S,S]
mask built from the sharded positions its compile fails). The math is the same as the reference's.

This adapter does not correct DeepSpeed: where AutoSP refuses a case (e.g. heads not divisible by P, an
attention mask it cannot rebuild) the run ends with DeepSpeed's own error, and where its numbers differ from
single-process training `autosp check` reports the difference. The loss returned is what a DeepSpeed user
logs: the mean over ranks of each rank's `outputs.loss`.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.precision import precision_of
from autosp.harness.strategy import Strategy, TrainStep, register
from baselines.deepspeed_env import engine_gradients, import_deepspeed, precision_config, require_deepspeed

if TYPE_CHECKING:
    from autosp.harness.parallel import ParallelContext
    from autosp.models.data import Batch


def autosp_config(cfg: RunConfig, sp_size: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31 - 1,
        "zero_optimization": {"stage": mixed_stage(cfg)},
        "compile": {"deepcompile": True, "passes": ["autosp"]},
        "sequence_parallel_size": sp_size,
    }
    return {**config, **precision_config(cfg.dtype, "ds-autosp", pure_bf16=True)}


def mixed_stage(cfg: RunConfig) -> int:
    """ZeRO 1 under mixed bf16 (DeepSpeed keeps fp32 master weights and gradients only in a ZeRO optimizer; its
    AutoSP composes with stage 0/1), else 0 (at stage 0 its bf16 trains everything in bf16)."""
    return 1 if precision_of(cfg.dtype).mixed else 0


class DeepSpeedAutoSPStep(TrainStep):
    implementation = "deepspeed-autosp (inductor)"

    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig) -> None:
        deepspeed = import_deepspeed("ds-autosp")
        from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

        self.prepare_autosp_inputs = prepare_autosp_inputs
        self.ctx = ctx
        self.mixed = precision_of(cfg.dtype).mixed
        if hasattr(model, "config"):  # hf:<preset>: HF's default, under which SDPA gets is_causal=True, no mask
            model.config.use_cache = True
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=autosp_config(cfg, ctx.sp_size)
        )
        self.engine.compile(backend="inductor")

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        rows = batch.input_ids.shape[0] // self.ctx.dp_size
        mine = batch.rows(self.ctx.dp_rank * rows, (self.ctx.dp_rank + 1) * rows).to(self.ctx.device)
        position_ids = mine.position_ids
        if position_ids is None:
            position_ids = torch.arange(mine.input_ids.shape[1], device=self.ctx.device).expand(rows, -1)
        # fresh tensors each step: prepare_autosp_inputs tags and marks them dynamic in place
        inputs = self.prepare_autosp_inputs(
            mine.input_ids.clone(), mine.labels.clone(), position_ids.clone(), mine.attention_mask, seq_dim=1
        )
        input_ids, labels, position_ids, attention_mask = inputs
        kwargs = {"attention_mask": attention_mask} if attention_mask is not None else {}
        loss = self.engine(input_ids=input_ids, labels=labels, position_ids=position_ids, **kwargs).loss
        self.engine.backward(loss)
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        return logged / dist.get_world_size()

    def optimizer_step(self) -> None:
        self.engine.step()  # also zeroes the gradients

    def local_gradients(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        return engine_gradients(self.engine)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        return {n: safe_get_full_grad(p).detach().cpu().clone() for n, p in self.engine.module.named_parameters()}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        if self.mixed:  # the fp32 masters, not the bf16 module copy
            from deepspeed.utils import safe_get_full_fp32_param

            return {n: safe_get_full_fp32_param(p).detach().cpu().clone()
                    for n, p in self.engine.module.named_parameters()}
        return {n: p.detach().cpu().clone() for n, p in self.engine.module.named_parameters()}


@register
class DeepSpeedAutoSP(Strategy):
    name = "ds-autosp"
    description = "DeepSpeed's reference AutoSP (deepcompile pass 'autosp', ZeRO-0), run as documented"
    sequence_parallel = True
    zero_stages = (0, 1)  # 1 only under mixed bf16 (`mixed_stage`)

    def zero_stage(self, cfg: RunConfig) -> int:
        return mixed_stage(cfg)

    def validate(self, cfg: RunConfig, num_heads: int, num_kv_heads: int) -> None:
        require_deepspeed(self.name)
        super().validate(cfg, num_heads, num_kv_heads)
        precision_config(cfg.dtype, self.name, pure_bf16=True)
        if cfg.zero not in (None, mixed_stage(cfg)):
            raise ConfigError(f"--method {self.name} runs ZeRO stage {mixed_stage(cfg)} under --dtype {cfg.dtype} "
                              "(stage 1 where DeepSpeed keeps fp32 master weights, i.e. mixed bf16); drop --zero")

    def setup(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig) -> TrainStep:
        return DeepSpeedAutoSPStep(model, ctx, cfg)
