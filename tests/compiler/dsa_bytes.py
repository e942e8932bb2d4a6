"""Bytes each rank sends per layer for DeepSeek sparse attention (gathered indexer keys and MLA latent) against
Ulysses' all-to-alls of the same MLA layer (DeepSeek-V3 at the same dims), counted off the SP pass's graph: one
rank's rewrite at P ranks, forward collectives (backward sends the same: a reduce-scatter per gather, an all-to-all
per all-to-all). `python -m tests.compiler.dsa_bytes [--real]`: --real uses DeepSeek-V3.2's attention dims
(128 heads, latent 512 + 64 rope, indexer 64 heads of 128) in one layer with a small hidden MLP."""
from __future__ import annotations

import sys
from collections import defaultdict

import torch
import transformers

import autosp.comm  # noqa: F401
from autosp.comm.library import op
from autosp.compiler.fx import module_path, user_path
from autosp.compiler.sp.walk import sequence_parallel_pass
from tests.compiler.graphs import capture
from tests.compiler.hf_models import COMMON, FAMILIES

_REAL = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_n_heads=64, index_head_dim=128,
             index_topk=16, num_hidden_layers=1, first_k_dense_replace=1, intermediate_size=64)


def sent_per_layer(config_class: str, model_class: str, overrides: dict, seq_len: int, sp_size: int) -> dict:
    """layer -> {collective: bytes this rank sends in forward}."""
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**COMMON, **overrides})
    model = getattr(transformers, model_class)._from_config(config).train()
    ids = torch.randint(0, 64, (1, seq_len))
    gm, _ = capture(model, input_ids=ids, labels=ids)
    sequence_parallel_pass(gm, sp_rank=0, sp_size=sp_size, group_name="unused")
    sent: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for node in gm.graph.nodes:
        if node.target not in (op("all_to_all").default, op("all_gather_sequence").default):
            continue
        value = node.args[0].meta["example_value"]
        if node.target == op("all_to_all").default:
            nbytes = value.numel() * value.element_size() * (sp_size - 1) // sp_size
        elif node.target == op("all_gather_sequence").default:
            nbytes = value.numel() * value.element_size() * (sp_size - 1)
        layer = ".".join(user_path(module_path(node) or "?").split(".")[:3])
        sent[layer][node.target.name().split("::")[-1]] += nbytes
    return {layer: dict(kinds) for layer, kinds in sent.items()}


def main() -> None:
    real = "--real" in sys.argv
    seq_len = 256 if real else 64  # not a head count: shapes tell the sequence dims apart by their size
    _, _, v32, _ = FAMILIES["deepseek-v32"]
    v32 = {**v32, **_REAL} if real else v32
    v3 = {k: v for k, v in v32.items() if not k.startswith("index_")}
    for sp_size in (2, 4, 8) if real else (2, 4):
        sparse = sent_per_layer("DeepseekV32Config", "DeepseekV32ForCausalLM", v32, seq_len, sp_size)
        ulysses = sent_per_layer("DeepseekV3Config", "DeepseekV3ForCausalLM", v3, seq_len, sp_size)
        for layer in sorted(sparse):
            tokens = seq_len // sp_size
            s, u = sum(sparse[layer].values()), sum(ulysses.get(layer, {}).values())
            print(f"P={sp_size} {layer}: DSA gathers {s / tokens:,.0f} B/token of shard {dict(sparse[layer])}; "
                  f"Ulysses all-to-alls {u / tokens:,.0f} B/token {dict(ulysses.get(layer, {}))}; ratio {u / s:.1f}")


if __name__ == "__main__":
    main()
