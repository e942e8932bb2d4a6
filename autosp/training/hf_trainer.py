"""The HF `Trainer` with AutoSP: `AutoSPTrainer(model=..., args=..., train_dataset=..., autosp_options={...})`.

A Trainer subclass, not a callback or an accelerate hook, because four things must change that only the
Trainer's own overridable methods reach (a callback sees events, not the dataloader or the optimizer, and
accelerate has no plug-in point for a compiler backend's sequence parallelism):
  - data: every rank of the SP group gets the full batch (accelerate would give each rank a different one);
  - the model: AutoSP compiles it (ZeRO sharding, SP graph) and reduces the gradients itself, so accelerate's DDP
    wrap (which would broadcast rank 0's shards over the others' and reduce the gradients twice) is skipped;
  - the optimizer: built over the module's parameters, the ZeRO 2/3 shards (the Trainer's own decay grouping);
  - clipping: `max_grad_norm` clips by the global norm over the sharded gradients, not one shard's norm.
The rest is the Trainer's: the loss the model computes (divided by the accumulated window's label count, equal to
the single-device loss on every rank), gradient accumulation, the LR schedule, logging. `bf16=True` means AutoSP's
mixed precision (bf16 compute, fp32 master weights, gradients and AdamW state), as `--dtype bfloat16`.
`save_model` exports the full weights (`autosp.training.checkpoint.export`; `from_pretrained` loads them).

What does not compose is refused in one line: fp16, torch_compile, gradient_checkpointing (AutoSP's `sac` does
it), DeepSpeed/FSDP, an SP degree below the world size, ZeRO stage 1, and the Trainer's own checkpoints
(`save_strategy`, `resume_from_checkpoint`: use `autosp.training.checkpoint`).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer

import autosp
from autosp.compiler.options import CompileOptions
from autosp.errors import SequenceParallelError
from autosp.training import checkpoint


class AutoSPTrainer(Trainer):
    """`transformers.Trainer` training `model` sequence parallel over all ranks with `autosp.compile`.

    autosp_options: `autosp.compile`'s options (a dict or `CompileOptions`: zero, sac, backend, tiling, ...);
    `compute_dtype` comes from `args.bf16`."""

    def __init__(self, *args: Any, autosp_options: dict | CompileOptions | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _refuse_what_does_not_compose(self.args)
        if isinstance(autosp_options, dict):
            autosp_options = CompileOptions.of(None, **autosp_options)
        options = CompileOptions.of(autosp_options, **({"compute_dtype": torch.bfloat16} if self.args.bf16 else {}))
        if options.zero == 1:
            raise SequenceParallelError("AutoSPTrainer: zero=1 (ZeroRedundancyOptimizer) does not take the Trainer's "
                                        "parameter groups; use zero=0, 2 or 3")
        # the ranks of one SP group share their batch: counting its labels on each would count them P times
        self.args.average_tokens_across_devices = False
        self.sp_model = autosp.compile(self.model, options=options)

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader=None) -> torch.nn.Module:
        return self.sp_model  # not the model itself: the Trainer then leaves it to AutoSP (no DDP wrap)

    def get_train_dataloader(self):
        """The Trainer's dataloader as one process would have it: every rank draws the same full batches."""
        self.accelerator.prepare = self._prepare_for_one_process
        try:
            return super().get_train_dataloader()
        finally:
            del self.accelerator.prepare  # the class's own method again

    def _prepare_for_one_process(self, data_loader):
        from accelerate.data_loader import prepare_data_loader

        acc = self.accelerator
        return prepare_data_loader(
            data_loader, acc.device, num_processes=1, process_index=0, split_batches=acc.split_batches,
            put_on_device=acc.device_placement, rng_types=acc.rng_types.copy(), dispatch_batches=acc.dispatch_batches,
            even_batches=acc.even_batches, use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed, non_blocking=acc.non_blocking,
            use_stateful_dataloader=acc.use_stateful_dataloader)

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        return self._global_norm(clip_to=self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm=None):
        return super()._get_grad_norm(model, self._global_norm(math.inf) if grad_norm is None else grad_norm)

    def _global_norm(self, clip_to: float) -> torch.Tensor:
        """The 2-norm of the whole model's gradient (ZeRO 2/3: each rank's shards' squares summed over the ranks;
        the shards' padding has no gradient), and every gradient scaled by min(1, clip_to / norm) as torch does."""
        params = [p for p in self.sp_model.parameters() if p.grad is not None]
        squares = torch.stack([p.grad.detach().float().pow(2).sum() for p in params]).sum()
        if self.sp_model.zero >= 2 and dist.get_world_size(self.sp_model.reduce_group) > 1:
            dist.all_reduce(squares, group=self.sp_model.reduce_group)
        norm = squares.sqrt()
        if clip_to != math.inf:
            torch.nn.utils.clip_grads_with_norm_(params, clip_to, norm)
        return norm

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: the full weights (and an HF config) in `output_dir`, written by rank 0."""
        checkpoint.export(output_dir or self.args.output_dir, self.sp_model)


def _refuse_what_does_not_compose(args) -> None:
    refusals = {
        "fp16": "fp16=True: AutoSP's mixed precision is bf16 (fp16 needs loss scaling); use bf16=True",
        "torch_compile": "torch_compile=True: AutoSP compiles the model itself; leave torch_compile off",
        "gradient_checkpointing": "gradient_checkpointing=True: AutoSP checkpoints in the graph; use "
                                  "autosp_options={'sac': 'full'} (or the default 'sac')",
        "deepspeed": "deepspeed: AutoSP shards the model state itself; use autosp_options={'zero': 3}",
        "fsdp": "fsdp: AutoSP shards the model state itself; use autosp_options={'zero': 3}",
        "resume_from_checkpoint": "resume_from_checkpoint: the Trainer's checkpoints hold unsharded optimizer state; "
                                  "resume with autosp.training.checkpoint.load",
    }
    for field, message in refusals.items():
        if getattr(args, field, None):
            raise SequenceParallelError(f"AutoSPTrainer: {message}")
    if str(getattr(args, "save_strategy", "no")) not in ("no", "SaveStrategy.NO"):
        raise SequenceParallelError("AutoSPTrainer: save_strategy other than 'no': the Trainer's checkpoints hold "
                                    "unsharded optimizer state; save with autosp.training.checkpoint.save (a callback "
                                    "or your loop) and call trainer.save_model() for the full weights")
