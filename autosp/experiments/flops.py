"""Analytic FLOPs of one Llama decoder layer, split into attention (QK^T, AV) and linear/MLP work.

Why it matters (paper §3B): the linear and MLP FLOPs grow as O(S) but attention as O(S^2), so the linear share
falls as O(1/S). Recomputing linear/MLP activations in backward (SAC) therefore costs less and less of the
step as sequences grow, while recomputing attention would not.

Conventions: a matmul [m,k]x[k,n] costs 2mkn FLOPs; backward costs twice the forward (input and weight
gradients; attention: dQ, dK, dV and dP); a causal mask computes only the S(S+1)/2 query-key pairs on or below
the diagonal; element-wise ops, norms and softmax are not counted. Per sequence (batch 1) unless `batch` says.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

import pandas as pd

from autosp.harness.config import ConfigError
from autosp.models import ModelPreset, get_preset

BACKWARD_FACTOR = 2  # backward FLOPs per forward FLOP


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one decoder layer, per operator."""

    q_proj: float
    k_proj: float
    v_proj: float
    o_proj: float
    gate_proj: float
    up_proj: float
    down_proj: float
    qk: float  # Q K^T scores
    av: float  # softmax(scores) V

    @property
    def attention(self) -> float:
        return self.qk + self.av

    @property
    def projections(self) -> float:
        return self.q_proj + self.k_proj + self.v_proj + self.o_proj

    @property
    def mlp(self) -> float:
        return self.gate_proj + self.up_proj + self.down_proj

    @property
    def linear(self) -> float:
        """Everything SAC recomputes: the q/k/v/o projections and the MLP."""
        return self.projections + self.mlp

    @property
    def total(self) -> float:
        return self.attention + self.linear


def layer_flops(preset: ModelPreset | str, seq_len: int, *, batch: int = 1, causal: bool = True,
                window: int | None = None) -> LayerFlops:
    """Forward FLOPs of one decoder layer of ``preset`` on ``batch`` sequences of ``seq_len`` tokens (``window``: a
    causal sliding window, each query attending to itself and the ``window - 1`` tokens before it)."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    if seq_len < 1 or batch < 1:
        raise ConfigError(f"seq_len and batch must be positive (got seq_len={seq_len}, batch={batch})")
    tokens = batch * seq_len
    d, hd, ff = p.hidden_size, p.head_dim, p.intermediate_size
    q_width, kv_width = p.num_attention_heads * hd, p.num_key_value_heads * hd
    pairs = seq_len * (seq_len + 1) / 2 if causal else seq_len * seq_len  # query-key pairs per sequence
    if window is not None and window < seq_len:
        pairs = window * (window + 1) / 2 + (seq_len - window) * window  # the first `window` queries see fewer
    per_pair = 2 * hd * p.num_attention_heads * batch  # one dot product per head (GQA shares K/V, not FLOPs)
    return LayerFlops(
        q_proj=2 * tokens * d * q_width,
        k_proj=2 * tokens * d * kv_width,
        v_proj=2 * tokens * d * kv_width,
        o_proj=2 * tokens * q_width * d,
        gate_proj=2 * tokens * d * ff,
        up_proj=2 * tokens * d * ff,
        down_proj=2 * tokens * ff * d,
        qk=per_pair * pairs,
        av=per_pair * pairs,
    )


def flops_table(preset: ModelPreset | str, seq_lens: list[int], *, batch: int = 1, causal: bool = True) -> pd.DataFrame:
    """One row per sequence length: per-layer attention vs linear/MLP FLOPs (forward and forward+backward),
    the linear share (falls as O(1/S)), and SAC's recompute overhead (one extra linear/MLP forward per
    layer, relative to the forward+backward step)."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    rows = []
    for s in seq_lens:
        f = layer_flops(p, s, batch=batch, causal=causal)
        step = (1 + BACKWARD_FACTOR) * f.total
        rows.append({
            "model": p.name,
            "seq_len": s,
            "attention_fwd": f.attention,
            "projections_fwd": f.projections,
            "mlp_fwd": f.mlp,
            "linear_fwd": f.linear,
            "attention_fwd_bwd": (1 + BACKWARD_FACTOR) * f.attention,
            "linear_fwd_bwd": (1 + BACKWARD_FACTOR) * f.linear,
            "linear_share": f.linear / f.total,
            "linear_per_attention": f.linear / f.attention,
            "sac_recompute_overhead": f.linear / step,
        })
    return pd.DataFrame(rows)


_SEQ = re.compile(r"^(\d+)([kKmM]?)$")


def parse_seq_lens(values: list[str]) -> list[int]:
    """``["1K,2K", "8192"]`` -> ``[1024, 2048, 8192]`` (K = 1024, M = 1024^2)."""
    out = []
    for item in ",".join(values).split(","):
        m = _SEQ.match(item.strip())
        if not m:
            raise ConfigError(f"bad sequence length {item!r}: use integers like 4096 or 4K, comma-separated")
        out.append(int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()])
    return out


def format_flops_table(df: pd.DataFrame) -> str:
    shown = df.copy()
    for col in ("attention_fwd", "projections_fwd", "mlp_fwd", "linear_fwd", "attention_fwd_bwd", "linear_fwd_bwd"):
        shown[col] = shown[col].map(lambda v: f"{v / 1e9:,.3f}")
    for col in ("linear_share", "sac_recompute_overhead"):
        shown[col] = shown[col].map(lambda v: f"{100 * v:.1f}%")
    shown["linear_per_attention"] = shown["linear_per_attention"].map(lambda v: f"{v:.4g}")
    return "per-layer GFLOPs (batch of one sequence)\n" + shown.to_string(index=False)


def _cmd_flops(args: argparse.Namespace) -> int:
    df = flops_table(args.model, parse_seq_lens(args.seq_lens), causal=not args.no_causal)
    print(df.to_csv(index=False) if args.csv else format_flops_table(df), end="" if args.csv else "\n")
    return 0


def add_flops_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp flops --model X --seq-lens 1K 2K ...`: the attention vs linear/MLP FLOPs table."""
    p = subparsers.add_parser("flops", help="analytic per-layer FLOPs: attention vs linear/MLP by sequence length")
    p.add_argument("--model", required=True, help="model preset, e.g. llama-3.1-8b, small")
    p.add_argument("--seq-lens", nargs="+", required=True, help="sequence lengths, e.g. 1K 4K 16K or 1024,4096")
    p.add_argument("--no-causal", action="store_true", help="count the full S x S attention (no causal mask)")
    p.add_argument("--csv", action="store_true", help="print CSV with raw FLOP counts")
    p.set_defaults(func=_cmd_flops)
