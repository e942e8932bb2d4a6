"""TRL's `SFTTrainer` with AutoSP: `AutoSPSFTTrainer(model=..., args=SFTConfig(...), train_dataset=...,
autosp_options={...})`, the same `AutoSPMixin` as `AutoSPTrainer`.

SFTTrainer's loss comes from a fused LM head it patches onto the model (per-token log-probabilities, tiled over the
vocabulary, outside the model's own loss); AutoSP's exact loss is the model's own, so the loss here is the plain
Trainer's (the model's cross entropy over the accumulated window's labels: the same number, and AutoSP's `tiling`
tiles it). SFTTrainer's metrics are kept exact: `mean_token_accuracy` and `entropy` from each rank's shard of the
logits, summed over the SP group; under `outputs='loss'` (needed to tile the loss) there are no logits and these two
metrics are not logged. Packing and `padding_free` compose (one row, position ids restarting per document, as
`DataCollatorWithFlattening`): AutoSP finds the documents from the position ids, so the flash-attention varlen
inputs the collator adds are dropped. What changes the loss away from the model's own (`loss_type='dft'`,
`compute_loss_func`, label smoothing, Liger kernels, `activation_offloading`) is refused in one line.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer
from trl import SFTTrainer

from autosp.errors import SequenceParallelError
from autosp.training.hf_trainer import AutoSPMixin

logger = logging.getLogger("autosp")

#: the collator's inputs for flash attention's varlen kernels; AutoSP reads document boundaries from position_ids
VARLEN_INPUTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class AutoSPSFTTrainer(AutoSPMixin, SFTTrainer):
    """`trl.SFTTrainer` training `model` sequence parallel over all ranks with `autosp.compile`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _refuse_what_does_not_compose(self.args, self.compute_loss_func)
        self._warned_no_logits = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's own loss (exact under AutoSP), and SFTTrainer's metrics from the logits' shards."""
        mode = "train" if self.model.training else "eval"
        inputs = {k: v for k, v in inputs.items() if k not in VARLEN_INPUTS} | {"use_cache": False}
        loss, outputs = Trainer.compute_loss(self, model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        self._log_token_metrics(mode, outputs.get("logits"), inputs["labels"])
        if mode == "train":
            # every rank holds the whole batch: the local count is the global one (no gather over the ranks)
            counted = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["position_ids"].size(1)
            self._total_train_tokens += int(counted)
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return (loss, outputs) if return_outputs else loss

    def _log_token_metrics(self, mode: str, logits: torch.Tensor | None, labels: torch.Tensor) -> None:
        """`mean_token_accuracy` and `entropy` over every valid next-token label of the batch: this rank's logits
        are positions [r*L, r*L + its length) of the sequence, L = ceil(S/P); the sums are taken over the SP group."""
        if logits is None:
            if not self._warned_no_logits:
                logger.warning("AutoSPSFTTrainer: outputs='loss' returns no logits, so mean_token_accuracy and entropy "
                               "are not logged")
                self._warned_no_logits = True
            return
        group = self.sp_model.sp_group
        start = dist.get_rank(group) * math.ceil(labels.size(1) / dist.get_world_size(group))
        following = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)  # the label each position predicts
        following = following[:, start:start + logits.size(1)]
        valid = following != -100
        with torch.no_grad():
            log_probs = torch.log_softmax(logits.detach().float(), dim=-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            correct = log_probs.argmax(-1) == following
            sums = torch.stack([valid.sum(), entropy[valid].sum(), (correct & valid).sum()]).double()
        dist.all_reduce(sums, group=group)
        count, entropy_sum, correct_sum = sums.tolist()
        self._metrics[mode]["entropy"].append(entropy_sum / count if count else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(correct_sum / count if count else 0.0)


def _refuse_what_does_not_compose(args, compute_loss_func) -> None:
    """What makes SFTTrainer's loss other than the model's own, or replaces what AutoSP compiles."""
    refusals = {
        "loss_type": (args.loss_type != "nll", "loss_type='dft' reweights SFTTrainer's fused per-token loss; use "
                                               "loss_type='nll'"),
        "compute_loss_func": (compute_loss_func is not None, "compute_loss_func needs the full logits; drop it (the "
                                                             "model's own loss is exact)"),
        "label_smoothing_factor": (args.label_smoothing_factor > 0, "label_smoothing_factor needs the full logits; "
                                                                    "set it to 0"),
        "use_liger_kernel": (args.use_liger_kernel, "use_liger_kernel replaces the model's kernels, and AutoSP "
                                                    "compiles the model itself; leave it off"),
        "activation_offloading": (args.activation_offloading, "activation_offloading: AutoSP offloads in the graph; "
                                                              "use autosp_options={'offload': 'activations'}"),
    }
    for name, (refused, message) in refusals.items():
        if refused:
            raise SequenceParallelError(f"AutoSPSFTTrainer: {message} ({name})")
