"""The HF `Trainer` with AutoSP: `AutoSPTrainer(model=..., args=..., train_dataset=..., autosp_options={...})`.

`AutoSPMixin` before any Trainer class in the bases makes that Trainer sequence parallel (`AutoSPTrainer` is it over
`transformers.Trainer`, `autosp.training.trl_trainer.AutoSPSFTTrainer` over TRL's SFTTrainer). A Trainer subclass,
not a callback or an accelerate hook, because four things must change that only the Trainer's own overridable
methods reach (a callback sees events, not the dataloader or the optimizer, and accelerate has no plug-in point for
a compiler backend's sequence parallelism):
  - data: every rank of the SP group gets the full batch, in training and evaluation (accelerate would give each
    rank a different one), so `evaluate()` gives the single-device eval loss;
  - the model: AutoSP compiles it (ZeRO sharding, SP graph) and reduces the gradients itself, so accelerate's DDP
    wrap (which would broadcast rank 0's shards over the others' and reduce the gradients twice) is skipped;
  - the optimizer: built over the module's parameters, the ZeRO 2/3 shards (the Trainer's own decay grouping);
  - clipping: `max_grad_norm` clips by the global norm over the sharded gradients, not one shard's norm.
The rest is the Trainer's: the loss the model computes (divided by the accumulated window's label count, equal to
the single-device loss on every rank), gradient accumulation, the LR schedule, logging. `bf16=True` means AutoSP's
mixed precision (bf16 compute, fp32 master weights, gradients and AdamW state), as `--dtype bfloat16`.
The Trainer's checkpoints (`save_steps`, `train(resume_from_checkpoint=...)`) hold the model and optimizer sharded
(`autosp.training.checkpoint`, resumable at another world size) and the full weights (`save_model` exports them;
`from_pretrained` loads them).

What does not compose is refused in one line: fp16, torch_compile, gradient_checkpointing (AutoSP's `sac` does
it), DeepSpeed/FSDP, ZeRO stage 1 (ZeroRedundancyOptimizer does not take the Trainer's parameter groups),
`compute_metrics` and `predict()` (they need the full logits; each rank holds a shard) and an SP group smaller
than the world (a DP x SP mesh: the Trainer's data split would have to follow the mesh).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

import autosp
from autosp.compiler.options import CompileOptions
from autosp.errors import SequenceParallelError
from autosp.training import checkpoint
from autosp.training.gradients import clip_grad_norm_

#: where in a Trainer checkpoint (`checkpoint-N/`) the sharded model and optimizer state go
SHARDED_DIR = "autosp"


class AutoSPMixin:
    """Put first in the bases of a `transformers.Trainer` class: that Trainer trains `model` sequence parallel over
    all ranks with `autosp.compile`.

    autosp_options: `autosp.compile`'s options (a dict or `CompileOptions`: zero, sac, backend, tiling, ...);
    `compute_dtype` comes from `args.bf16`."""

    def __init__(self, *args: Any, autosp_options: dict | CompileOptions | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _refuse_what_does_not_compose(self.args)
        if self.compute_metrics is not None:
            raise SequenceParallelError("AutoSPTrainer: compute_metrics needs the full logits, and each SP rank holds "
                                        "a shard of them; drop compute_metrics (the eval loss is exact)")
        if isinstance(autosp_options, dict) and {"sp_size", "process_group"} & autosp_options.keys():
            raise SequenceParallelError("AutoSPTrainer: sp_size/process_group (an SP group smaller than the world, a "
                                        "DP x SP mesh) is not supported, the Trainer's data split does not follow the "
                                        "mesh; leave them unset (one SP group of all ranks)")
        if isinstance(autosp_options, dict):
            autosp_options = CompileOptions.of(None, **autosp_options)
        options = CompileOptions.of(autosp_options, **({"compute_dtype": torch.bfloat16} if self.args.bf16 else {}))
        if options.zero == 1:
            raise SequenceParallelError("AutoSPTrainer: zero=1 (ZeroRedundancyOptimizer) does not take the Trainer's "
                                        "parameter groups; use zero=0, 2 or 3")
        if options.host_adam is not None:
            raise SequenceParallelError("AutoSPTrainer: offload=optimizer needs the optimizer make_optimizer builds "
                                        "(host masters), not the Trainer's; drop the optimizer item of offload")
        plan = options.offload_plan  # the Trainer builds its own optimizer: the state stays where it puts it
        options = CompileOptions.of(options, offload=dataclasses.replace(
            plan, optimizer=plan.optimizer.replace("auto", "off"), params=plan.params.replace("auto", "off")))
        # the ranks of one SP group share their batch: counting its labels on each would count them P times
        self.args.average_tokens_across_devices = False
        self.sp_model = autosp.compile(self.model, options=options)

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader=None) -> torch.nn.Module:
        return self.sp_model  # not the model itself: the Trainer then leaves it to AutoSP (no DDP wrap)

    def _get_dataloader(self, *args: Any, **kwargs: Any):
        """The Trainer's dataloaders (train, eval, test) as one process would have them: every rank draws the same
        full batches."""
        self.accelerator.prepare = self._prepare_for_one_process
        try:
            return super()._get_dataloader(*args, **kwargs)
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

    def predict(self, *args: Any, **kwargs: Any):
        raise SequenceParallelError("AutoSPTrainer: predict() returns the full logits, and each SP rank holds a shard "
                                    "of them; use evaluate() for the loss, or the model itself for logits")

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        return clip_grad_norm_(self.sp_model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm=None):
        return super()._get_grad_norm(model, clip_grad_norm_(self.sp_model) if grad_norm is None else grad_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: the full weights (and an HF config) in `output_dir`, written by rank 0."""
        checkpoint.export(output_dir or self.args.output_dir, self.sp_model)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's checkpoint: model and optimizer sharded (`autosp.training.checkpoint`), the schedule's
        counters beside them; it resumes at any world size."""
        numbers = {f"lr_scheduler.{k}": v for k, v in self.lr_scheduler.state_dict().items()
                   if isinstance(v, (bool, int, float))}
        checkpoint.save(Path(output_dir) / SHARDED_DIR, self.sp_model, _unwrapped(self.optimizer), extra=numbers)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Nothing here: the model is loaded with the optimizer, from the sharded checkpoint."""

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        extra = checkpoint.load(Path(checkpoint_dir) / SHARDED_DIR, self.sp_model, _unwrapped(self.optimizer))
        state = self.lr_scheduler.state_dict()
        state.update({k.removeprefix("lr_scheduler."): v for k, v in extra.items() if k.startswith("lr_scheduler.")})
        self.lr_scheduler.load_state_dict(state)
        self.lr_scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]


class AutoSPTrainer(AutoSPMixin, Trainer):
    """`transformers.Trainer` training `model` sequence parallel over all ranks with `autosp.compile`."""


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the optimizer


def _refuse_what_does_not_compose(args) -> None:
    refusals = {
        "fp16": "fp16=True: AutoSP's mixed precision is bf16 (fp16 needs loss scaling); use bf16=True",
        "torch_compile": "torch_compile=True: AutoSP compiles the model itself; leave torch_compile off",
        "gradient_checkpointing": "gradient_checkpointing=True: AutoSP checkpoints in the graph; use "
                                  "autosp_options={'sac': 'full'} (or the default 'sac')",
        "deepspeed": "deepspeed: AutoSP shards the model state itself; use autosp_options={'zero': 3}",
        "fsdp": "fsdp: AutoSP shards the model state itself; use autosp_options={'zero': 3}",
    }
    for field, message in refusals.items():
        if getattr(args, field, None):
            raise SequenceParallelError(f"AutoSPTrainer: {message}")
