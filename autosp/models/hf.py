"""`hf:<preset>`: the preset's hyper-parameters built as HF transformers' own LlamaForCausalLM
(`hf-mistral:` / `hf-qwen2:` build Mistral / Qwen2 instead, `-w<N>` with a sliding window of N tokens;
`hf-mixtral:` / `hf-deepseek-v3:` a mixture of experts / multi-head latent attention with experts,
`hf-deepseek-v32:` the latter with DeepSeek sparse attention; `hf-qwen3.5:` Qwen3.5's hybrid of gated delta-net
linear attention and full attention).

Real third-party model code, so the compiler and baselines are tested on what users actually train.
transformers is an optional extra (`pip install "autosp[hf]"`).
"""

from __future__ import annotations

from torch import nn

from autosp.errors import ConfigError
from autosp.models.presets import HFVariant, ModelPreset

MOE_EXPERTS, MOE_TOP_K = 4, 2  # routed experts per MoE layer and experts per token (hf-mixtral, hf-deepseek-v3)
# DeepSeek-V3.2's indexer (hf-deepseek-v32): its heads and head dim as a share of the preset's (64 of 128 heads,
# 128 wide, in the real model), and the keys it keeps per query (2048 in the real model)
INDEX_TOPK = 256


def _family_config(preset: ModelPreset, variant: HFVariant) -> dict:
    """The config entries a family adds to the preset's: its window, or its experts and latent attention.

    DeepSeek-V3: latent query rank hidden/2, latent key/value rank hidden/4, each head's dims split half rope,
    half no-rope (values a full head), one dense layer then MoE layers of routed experts a quarter of the
    preset's MLP wide plus one shared expert, one routing group. DeepSeek-V3.2: the same, and an indexer of half
    the heads, each a head wide, keeping INDEX_TOPK keys per query."""
    if variant.family == "mistral":
        return {"sliding_window": variant.sliding_window}
    if variant.family == "qwen2":
        return {"use_sliding_window": variant.sliding_window is not None, "sliding_window": variant.sliding_window,
                "max_window_layers": preset.num_layers // 2}
    if variant.family == "mixtral":
        return {"num_local_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K}
    if variant.family == "deepseek-v32":
        return {**_family_config(preset, HFVariant("deepseek-v3", None)), "index_topk": INDEX_TOPK,
                "index_n_heads": max(1, preset.num_attention_heads // 2), "index_head_dim": preset.head_dim}
    if variant.family == "deepseek-v3":
        return {"num_key_value_heads": preset.num_attention_heads, "q_lora_rank": preset.hidden_size // 2,
                "kv_lora_rank": preset.hidden_size // 4, "qk_rope_head_dim": preset.head_dim // 2,
                "qk_nope_head_dim": preset.head_dim // 2, "v_head_dim": preset.head_dim,
                "n_routed_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K, "n_shared_experts": 1,
                "moe_intermediate_size": preset.intermediate_size // 4, "first_k_dense_replace": 1,
                "n_group": 1, "topk_group": 1}
    if variant.family == "qwen3.5":
        return {"layer_types": qwen3_5_layer_types(preset.num_layers), "head_dim": preset.head_dim,
                "linear_num_value_heads": preset.num_attention_heads,
                "linear_num_key_heads": preset.num_key_value_heads, "linear_key_head_dim": preset.head_dim,
                "linear_value_head_dim": preset.head_dim}
    return {}


def qwen3_5_layer_types(num_layers: int) -> list[str]:
    """Qwen3.5's layout: three gated delta-net layers, then one full-attention layer (the last layer full attention
    when the model has fewer than four); its linear heads are the preset's query/KV heads at the preset's head dim."""
    interval = min(4, num_layers)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def build_hf_llama(preset: ModelPreset, variant: HFVariant = HFVariant("llama", None)) -> nn.Module:
    """HF LlamaForCausalLM (or the variant's Mistral/Qwen2/Mixtral/DeepseekV3) for the preset (sdpa attention,
    no KV cache); `build_model` seeds its weights. Qwen2 windows the upper half of its layers (`max_window_layers`)."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            f"model 'hf:{preset.name}' needs HF transformers, which is not installed: "
            'pip install "autosp[hf]" or use the model name without "hf:"'
        ) from exc
    family = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "mixtral": "Mixtral",
              "deepseek-v3": "DeepseekV3", "deepseek-v32": "DeepseekV32", "qwen3.5": "Qwen3_5"}[variant.family]
    config_name = "Qwen3_5TextConfig" if variant.family == "qwen3.5" else f"{family}Config"
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, f"{family}ForCausalLM")
    config = config_class(**{
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": preset.rope_theta},
        "tie_word_embeddings": preset.tie_word_embeddings,
        "use_cache": False,
        **_family_config(preset, variant),
    })
    return model_class._from_config(config, attn_implementation="sdpa")
