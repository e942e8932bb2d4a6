"""What `--dtype` means: the dtype a model computes in and the dtype its training state is kept in.

`bfloat16` is mixed precision as practitioners run it: the forward and backward compute in bf16 and the
activations (all-to-alls included) travel in bf16, while the state that accumulates many small updates stays fp32 —
master parameters (an AdamW step of lr * ~1 relative to a weight of ~1e-2 would vanish under bf16's 2^-8
spacing), gradients and their reduction (summing P partial gradients in bf16 loses the low bits of each), and
AdamW's moments (the second moment squares gradients: bf16 would flush small ones). The pure variants keep
everything in the 16-bit dtype and are named so. Mixed float16 would also need dynamic loss scaling (fp16's
range is too short for small gradients), which no method here implements, so it is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autosp.errors import ConfigError


@dataclass(frozen=True)
class Precision:
    """`compute`: parameters as the model's code sees them, activations, communication of activations.
    `state`: master parameters, gradients (and their reduction), AdamW moments."""

    name: str
    compute: torch.dtype
    state: torch.dtype

    @property
    def mixed(self) -> bool:
        return self.compute != self.state

    @property
    def label(self) -> str:
        """What ran, as records and the floor name it: float32, bfloat16-mixed, bfloat16-pure, float16-pure."""
        compute = str(self.compute).removeprefix("torch.")
        if self.mixed:
            return f"{compute}-mixed"
        return compute if self.compute == torch.float32 else f"{compute}-pure"


PRECISIONS = {p.name: p for p in (
    Precision("float32", torch.float32, torch.float32),
    Precision("bfloat16", torch.bfloat16, torch.float32),
    Precision("bfloat16-pure", torch.bfloat16, torch.bfloat16),
    Precision("float16-pure", torch.float16, torch.float16),
)}


def precision_of(dtype: str) -> Precision:
    """The Precision `--dtype dtype` names; ConfigError for an unknown name or mixed float16."""
    if dtype == "float16":
        raise ConfigError("--dtype float16 (mixed) needs dynamic loss scaling, which no method here implements; "
                          "use --dtype bfloat16 (bf16 compute, fp32 state) or float16-pure")
    if dtype not in PRECISIONS:
        raise ConfigError(f"unknown --dtype {dtype!r}; choose one of: {', '.join(PRECISIONS)}")
    return PRECISIONS[dtype]
