"""Paper-scale consequence of each memory lever, added in turn: the longest sequence per 8x80 GiB node (say)
when AutoSP adds SAC, a tiled loss, tiled MLPs, sharded model state and activation offload, one after another.

An estimate, not a bound (the floor, `autosp.experiments.floor`, is the bound): bytes per local token are
counted from the model's shape for what each configuration keeps at the peak of backward —
- saved activations per layer: without SAC every op input a stock partitioner keeps (the two norms' inputs and
  outputs, q/k/v, attention output, the residual, the MLP's gate, up, activation and product: 6d + 2kv + 4I
  elements); with this project's SAC the layer output, the all-to-all'd q/k/v, the attention output and its
  all-to-all back (4d + 2kv elements) and attention's fp32 logsumexp per head;
- the working set of the layer being recomputed: its MLP intermediates (4I elements per token) unless tiled;
- the loss's working set: logits in the model dtype, their fp32 copy and fp32 gradient (V x (e + 8) bytes per
  token) unless tiled;
- offload (`--offload activations`, `autosp.compiler.memory.offload`) moves what is kept at the layer boundaries, the
  residual stream (d elements per token per layer), to host memory but for `DEVICE_WINDOW` layers' (the one in
  backward, its successor reloaded late): the floor's model (`floor.memory_floor(offload=True)`). The rest of what
  SAC saves inside a layer (attention's inputs and output) stays on the device. Host bytes are reported per rank.
Model state comes from the floor (replicated, or sharded ZeRO-3 style with one gathered unit).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import pandas as pd
import torch

from autosp.experiments.floor import floor_for
from autosp.harness.measure import format_size, parse_size
from autosp.harness.precision import precision_of
from autosp.models.presets import ModelPreset, get_preset

#: ALST (Arctic Long Sequence Training): Llama-3.1-8B on one node of 8 H100-80GB with tiled loss, TiledMLP,
#: checkpoint offload, Ulysses SP and ZeRO-3 (published figure, for comparison beside the estimate)
ALST_LLAMA_3_1_8B_8X80 = 3_700_000

LEVERS = ("sac", "tiled loss", "tiled mlp", "sharded state", "offload")


@dataclass(frozen=True)
class TokenBytes:
    """Bytes per local token kept at the peak, by what keeps them."""

    saved_on_device: float
    mlp_working: float
    loss_working: float
    saved_on_host: float

    @property
    def device(self) -> float:
        return self.saved_on_device + self.mlp_working + self.loss_working


def token_bytes(preset: ModelPreset, levers: set[str], elem: int, offloaded: float = 0) -> TokenBytes:
    """`offloaded`: bytes per token the offload lever keeps in host memory (the floor's `host_bytes_per_token`)."""
    d, inter, vocab, layers = preset.hidden_size, preset.intermediate_size, preset.vocab_size, preset.num_layers
    kv = preset.num_key_value_heads * preset.head_dim
    if "sac" in levers:
        per_layer = (4 * d + 2 * kv) * elem + 4 * preset.num_attention_heads
    else:
        per_layer = (6 * d + 2 * kv + 4 * inter) * elem
    return TokenBytes(
        saved_on_device=per_layer * layers - offloaded,
        mlp_working=0 if "tiled mlp" in levers else 4 * inter * elem,
        loss_working=0 if "tiled loss" in levers else vocab * (elem + 8),
        saved_on_host=offloaded,
    )


def lever_table(model: str, *, world_size: int, device_bytes: int, dtype: str = "bfloat16") -> pd.DataFrame:
    """One row per configuration: none, then each lever of LEVERS added to the previous row's. `dtype` is a run's
    `--dtype`: activations in its compute dtype, model state as it keeps it (`bfloat16`: mixed, fp32 state)."""
    preset = get_preset(model)
    elem = torch.empty((), dtype=precision_of(dtype).compute).element_size()
    rows = []
    for n in range(len(LEVERS) + 1):
        levers = set(LEVERS[:n])
        method, zero = ("zero3", 3) if "sharded state" in levers else ("autosp", 0)  # replicated until that lever
        floor = floor_for(method, model, world_size=world_size, dtype=dtype, zero=zero, offload="offload" in levers)
        state = floor.static_bytes
        per_token = token_bytes(preset, levers, elem, offloaded=floor.host_bytes_per_token)
        local_tokens = max(0.0, (device_bytes - state) / per_token.device)
        seq_len = int(local_tokens * world_size)  # Ulysses: each rank keeps S / world_size tokens
        rows.append({
            "levers": "+ " + LEVERS[n - 1] if n else "autosp (no lever)",
            "model state / rank": format_size(state),
            "KiB / local token": round(per_token.device / 1024, 1),
            "max sequence": seq_len,
            "host bytes / rank": format_size(per_token.saved_on_host * local_tokens) if "offload" in levers else "-",
        })
    return pd.DataFrame(rows).set_index("levers")


def add_levers_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("levers", help="paper-scale max length with each memory lever added in turn (estimate)")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--device-memory", default="80GiB", help="bytes per device, e.g. 80GiB")
    p.add_argument("--dtype", default="bfloat16")
    p.set_defaults(func=_cmd_levers)


def _cmd_levers(args: argparse.Namespace) -> int:
    table = lever_table(args.model, world_size=args.world_size, device_bytes=parse_size(args.device_memory),
                        dtype=args.dtype)
    print(table.to_string())
    if args.model == "llama-3.1-8b" and args.world_size == 8:
        print(f"ALST (published, 8x H100-80GB, all of these levers): {ALST_LLAMA_3_1_8B_8X80:,} tokens")
    return 0
