"""`scaled_dot_product_attention` as Dynamo records it: which calls are SDPA, and their arguments by name.

A leaf the SP steps share (analysis finds the sites, communicate rewrites them, masks reads their masks)."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


def attention_args(node: fx.Node) -> dict[str, Any]:
    """SDPA's arguments by name, defaults filled in (Dynamo records them positionally or by keyword)."""
    bound = dict(SDPA_DEFAULTS)
    bound.update(zip(SDPA_PARAMS, node.args))
    bound.update(node.kwargs)
    return bound
