"""Pass 2, tiling: the LM head + cross-entropy over tiles of the local tokens (`loss`, its kernel `loss_op`), token-wise
blocks such as the MLP in token tiles (`mlp`), Llama's RMSNorm as one kernel over chunks of tokens (`norm`, its
kernel `rms_norm_op`). The names below are the tiling option and the pass, what the driver and the harness import;
the modules are private to this package."""
from __future__ import annotations

from autosp.compiler.tiling.loss import Tiling, TilingReport, apply_tiling, check_outputs, describe, parse_tiling
from autosp.compiler.tiling.mlp import TILE_KEY

__all__ = ["TILE_KEY", "Tiling", "TilingReport", "apply_tiling", "check_outputs", "describe", "parse_tiling"]
