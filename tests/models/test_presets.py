import pytest

from autosp.harness.config import ConfigError
from autosp.models import get_preset, model_names, parameter_count

# Exact counts of the published checkpoints (HF hub; tied embeddings counted once).
PUBLISHED_PARAMETERS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "llama-2-13b": 13_015_864_320,
    "tinyllama-1.1b": 1_100_048_384,
}


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMETERS))
def test_parameter_count_matches_published_model(name):
    assert parameter_count(name) == pytest.approx(PUBLISHED_PARAMETERS[name], rel=0.005)
    assert parameter_count(name) == PUBLISHED_PARAMETERS[name]


def test_hf_form_has_same_parameter_count():
    assert parameter_count("hf:llama-3.2-1b") == PUBLISHED_PARAMETERS["llama-3.2-1b"]


def test_cpu_presets_are_small_gqa_except_tiny_mha():
    for name in ("tiny", "small"):
        p = get_preset(name)
        assert p.num_key_value_heads < p.num_attention_heads and p.num_layers >= 2
        assert parameter_count(name) < 2_000_000
    mha = get_preset("tiny-mha")
    assert mha.num_key_value_heads == mha.num_attention_heads
    assert get_preset("tiny").head_dim == 16


def test_hf_prefix_gives_same_preset_and_names_list_both_forms():
    assert get_preset("hf:small") == get_preset("small")
    names = model_names()
    assert "tiny" in names and "hf:tiny" in names and "llama-3.1-8b" in names


def test_unknown_model_lists_valid_names():
    with pytest.raises(ConfigError, match="unknown model 'llama-9'.*tiny.*hf:tiny"):
        get_preset("llama-9")
