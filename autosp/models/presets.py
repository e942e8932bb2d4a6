"""Model hyper-parameters by name: the published Llama configs the paper trains, plus CPU-sized presets.

The published values are copied into code (not read from a file) so a clone of the repository is enough.
Any preset can also be asked for as ``hf:<preset>``: the same hyper-parameters built as HF transformers code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autosp.errors import ConfigError

HF_PREFIX = "hf:"
# hf:<preset> (Llama), hf-mistral:<preset>, hf-qwen2:<preset> (-w<N> adds a sliding attention window of N tokens),
# hf-mixtral:<preset> (mixture of experts), hf-deepseek-v3:<preset> (multi-head latent attention + experts),
# hf-deepseek-v32:<preset> (the same with DeepSeek sparse attention's indexer),
# hf-qwen3.5:<preset> (Qwen3.5's hybrid: gated delta-net layers, every fourth layer full attention)
HF_FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "deepseek-v3", "deepseek-v32", "qwen3.5")
_HF_NAME = re.compile(r"^hf(?:-(?:(mistral|qwen2)(?:-w([1-9][0-9]*))?|"
                      r"(mixtral|deepseek-v32|deepseek-v3|qwen3\.5)))?:(.+)$")


@dataclass(frozen=True)
class ModelPreset:
    """Hyper-parameters of one Llama-architecture decoder."""

    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5  # the published Llama 2/3 configs all use 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        # Published configs (HF hub config.json of each model).
        ModelPreset("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, 500000.0, True, 131072),
        ModelPreset("llama-3.2-3b", 3072, 28, 24, 8, 8192, 128256, 500000.0, True, 131072),
        ModelPreset("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, 500000.0, False, 131072),
        ModelPreset("llama-2-13b", 5120, 40, 40, 40, 13824, 32000, 10000.0, False, 4096),
        # TinyLlama-1.1B (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T): a 1B-class Llama whose LM head is
        # untied, which alst needs (tests/gpu/peer_check.sh compares the methods on one GPU with it)
        ModelPreset("tinyllama-1.1b", 2048, 22, 32, 4, 5632, 32000, 10000.0, False, 2048),
        # CPU presets: same architecture (GQA, several layers), small enough that a step takes milliseconds.
        ModelPreset("tiny", 64, 2, 4, 2, 176, 512, 10000.0, False, 131072),
        ModelPreset("tiny-mha", 64, 2, 4, 4, 176, 512, 10000.0, False, 131072),
        ModelPreset("small", 128, 4, 8, 4, 352, 2048, 10000.0, False, 131072),
        # Llama-3-8B's ratios at CPU size: vocabulary / hidden 31.25 (8B: 31.3), intermediate / hidden 3.5,
        # 4:1 GQA, 4 layers, so the loss's share of memory at the peak is the one the paper-scale model has.
        ModelPreset("llama3-mini", 128, 4, 8, 2, 448, 4000, 500000.0, False, 131072),
        # `tiny` with the LM head tied to the embedding (as llama-3.2-1b/3b): one weight, two gradient paths.
        ModelPreset("tiny-tied", 64, 2, 4, 2, 176, 512, 10000.0, True, 131072),
    )
}


def preset_names() -> list[str]:
    """Names of the presets themselves (without the ``hf:`` forms)."""
    return list(PRESETS)


def model_names() -> list[str]:
    """Every name `build_model` accepts: each preset and its ``hf:<preset>`` form (also ``hf-mistral:``,
    ``hf-qwen2:``, with ``-w<N>`` for a sliding window of N tokens, e.g. ``hf-mistral-w64:tiny``, and
    ``hf-mixtral:``, ``hf-deepseek-v3:``, ``hf-deepseek-v32:``, ``hf-qwen3.5:``)."""
    return preset_names() + [HF_PREFIX + name for name in PRESETS]


def is_hf_name(name: str) -> bool:
    return _HF_NAME.match(name) is not None


@dataclass(frozen=True)
class HFVariant:
    family: str  # one of HF_FAMILIES
    sliding_window: int | None


def hf_variant(name: str) -> HFVariant:
    """Which HF model class and attention window an ``hf...:<preset>`` name asks for."""
    match = _HF_NAME.match(name)
    if match is None:
        raise ConfigError(f"{name!r} is not an HF model name (hf:<preset>, hf-mistral[-w<N>]:<preset>, ...)")
    windowed, window, plain, _ = match.groups()
    return HFVariant(windowed or plain or "llama", int(window) if window else None)


def get_preset(name: str) -> ModelPreset:
    """The preset for ``name`` (``hf:<preset>`` gives the same hyper-parameters)."""
    match = _HF_NAME.match(name)
    preset = PRESETS.get(match.group(4) if match else name)
    if preset is None:
        raise ConfigError(f"unknown model {name!r}; choose one of: {', '.join(model_names())}")
    return preset
