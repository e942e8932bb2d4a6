"""`hf:<preset>`: the preset's hyper-parameters built as HF transformers' own LlamaForCausalLM.

Real third-party model code, so the compiler and baselines are tested on what users actually train.
transformers is an optional extra (`pip install "autosp[hf]"`).
"""

from __future__ import annotations

from torch import nn

from autosp.harness.config import ConfigError
from autosp.models.presets import ModelPreset


def build_hf_llama(preset: ModelPreset) -> nn.Module:
    """HF LlamaForCausalLM for the preset (sdpa attention, no KV cache); `build_model` seeds its weights."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise ConfigError(
            f"model 'hf:{preset.name}' needs HF transformers, which is not installed: "
            'pip install "autosp[hf]" or use the model name without "hf:"'
        ) from exc
    config = LlamaConfig(
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
    )
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
