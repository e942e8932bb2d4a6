"""Per-layer activation checkpointing for the baselines (`--ac layer`, or `ulysses[ac=layer]` in a method list), the
way practitioners run them at long context: each decoder layer keeps only its input for backward and reruns its
forward there (non-reentrant `torch.utils.checkpoint`, attention with its collectives included)."""
from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from autosp.harness.config import RunConfig


def checkpoint_layers(model: nn.Module) -> None:
    """Each decoder layer's forward becomes checkpoint(original forward), parameters not renamed (so FSDP2 and
    ZeRO-3, applied afterwards, wrap the same modules and names)."""
    for layer in model.model.layers:
        layer.forward = functools.partial(checkpoint, type(layer).forward.__get__(layer), use_reentrant=False)


def apply_activation_checkpointing(model: nn.Module, cfg: RunConfig) -> str:
    """Checkpoint every decoder layer when `cfg.ac == "layer"`; the suffix the record's implementation gets."""
    if cfg.ac == "layer":
        checkpoint_layers(model)
        return "+ac"
    return ""
