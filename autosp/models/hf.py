"""`hf:<preset>`: the preset's hyper-parameters built as HF transformers' own LlamaForCausalLM
(`hf-mistral:` / `hf-qwen2:` build Mistral / Qwen2 instead, `-w<N>` with a sliding window of N tokens).

Real third-party model code, so the compiler and baselines are tested on what users actually train.
transformers is an optional extra (`pip install "autosp[hf]"`).
"""

from __future__ import annotations

from torch import nn

from autosp.errors import ConfigError
from autosp.models.presets import HFVariant, ModelPreset


def build_hf_llama(preset: ModelPreset, variant: HFVariant = HFVariant("llama", None)) -> nn.Module:
    """HF LlamaForCausalLM (or the variant's Mistral/Qwen2) for the preset (sdpa attention, no KV cache);
    `build_model` seeds its weights. Qwen2 windows the upper half of its layers (`max_window_layers`)."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            f"model 'hf:{preset.name}' needs HF transformers, which is not installed: "
            'pip install "autosp[hf]" or use the model name without "hf:"'
        ) from exc
    window: dict = {}
    if variant.family == "mistral":
        window = {"sliding_window": variant.sliding_window}
    elif variant.family == "qwen2":
        window = {"use_sliding_window": variant.sliding_window is not None, "sliding_window": variant.sliding_window,
                  "max_window_layers": preset.num_layers // 2}
    family = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[variant.family]
    config_class, model_class = getattr(transformers, f"{family}Config"), getattr(transformers, f"{family}ForCausalLM")
    config = config_class(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=preset.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
        tie_word_embeddings=preset.tie_word_embeddings,
        use_cache=False,
        **window,
    )
    return model_class._from_config(config, attn_implementation="sdpa")
