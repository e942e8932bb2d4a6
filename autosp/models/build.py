"""Build any model by name with a seeded initialisation that is identical on every device, rank and backend.

Weights are drawn on the CPU from a generator seeded by (seed, parameter name), so the project Llama and
`hf:<preset>` (which share parameter names) get the same weights, independent of construction order.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch
from torch import nn

from autosp.models.hf import build_hf_llama
from autosp.models.llama import LlamaForCausalLM
from autosp.models.presets import get_preset, hf_variant, is_hf_name

INIT_STD = 0.02  # HF LlamaConfig.initializer_range default


def init_parameters(model: nn.Module, seed: int) -> None:
    """Normal(0, 0.02) for every matrix, ones for norm weights; each parameter from its own seeded generator."""
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights appear once, under their first name
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            generator = torch.Generator(device="cpu").manual_seed(
                seed * 1_000_003 + zlib.crc32(name.encode())
            )
            param.normal_(0.0, INIT_STD, generator=generator)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters only: RoPE's inv_freq stays fp32 as in HF (in bf16 it skews long positions)."""
    for param in model.parameters():
        param.data = param.data.to(dtype)


def build_model(
    name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    num_layers: int | None = None,
) -> nn.Module:
    """The model `name` in train mode: a preset (project Llama) or ``hf:<preset>`` (HF transformers Llama).

    ``device="meta"`` builds shapes only (no memory, no initialisation), e.g. to count parameters.
    `num_layers` overrides the preset's depth (the simulator runs 2- and 3-layer versions of a model).
    """
    preset = get_preset(name)
    if num_layers is not None:
        preset = dataclasses.replace(preset, num_layers=num_layers)
    construct = (lambda p: build_hf_llama(p, hf_variant(name))) if is_hf_name(name) else LlamaForCausalLM
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            model = construct(preset)
    else:
        # Built and initialised on the CPU, then moved: every device and rank gets identical weights.
        model = construct(preset)
        init_parameters(model, seed)
        if torch.device(device) != torch.device("cpu"):  # (a no-op move, which fake tensors cannot make)
            model.to(device=device)
    cast_parameters(model, dtype)
    return model.train()


def parameter_count(name: str) -> int:
    """Number of distinct parameters (tied embeddings counted once), from a meta-device build."""
    return sum(p.numel() for p in build_model(name, device="meta").parameters())
