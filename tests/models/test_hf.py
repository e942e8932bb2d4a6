import dataclasses
import sys

import pytest
import torch

from autosp.harness.config import ConfigError, DataConfig, RunConfig
from autosp.models import build_model, get_preset
from autosp.models.build import init_parameters
from autosp.models.data import make_batch
from autosp.models.hf import build_hf_llama
from autosp.models.llama import LlamaForCausalLM

pytest.importorskip("transformers")

BATCHES = {
    "plain": DataConfig(),
    "ignored": DataConfig(ignore_fraction=0.3),
    "padded": DataConfig(pad_fraction=0.25),
    "packed": DataConfig(packed_documents=3),
}


def test_hf_model_is_real_transformers_code_configured_like_the_preset():
    model = build_model("hf:tiny")
    assert type(model).__module__.startswith("transformers.")
    cfg = model.config
    assert cfg.use_cache is False and cfg._attn_implementation == "sdpa" and model.training
    assert (cfg.num_key_value_heads, cfg.num_hidden_layers, cfg.intermediate_size) == (2, 2, 176)


@pytest.mark.parametrize("kind", list(BATCHES))
def test_project_llama_matches_hf_with_copied_weights(kind):
    ours = LlamaForCausalLM(get_preset("tiny"))
    hf = build_model("hf:tiny", seed=5)
    # Copy HF's weights into the project model: the parameter names are HF's own, so the map is the identity.
    ours.load_state_dict(hf.state_dict())
    b = make_batch(BATCHES[kind], batch_size=2, seq_len=32, vocab_size=512, seed=1)
    mine, theirs = ours(**b.model_kwargs()), hf(**b.model_kwargs())
    torch.testing.assert_close(mine.logits, theirs.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-6, rtol=1e-6)
    n = b.num_valid_labels()
    torch.testing.assert_close(
        ours(**b.model_kwargs(), num_items_in_batch=n).loss, hf(**b.model_kwargs(), num_items_in_batch=n).loss
    )


def test_same_seed_gives_same_weights_in_both_implementations_tied_too():
    assert (
        build_model("tiny", seed=2).state_dict().keys() == build_model("hf:tiny", seed=2).state_dict().keys()
    )
    preset = dataclasses.replace(get_preset("tiny"), tie_word_embeddings=True)
    ours, hf = LlamaForCausalLM(preset), build_hf_llama(preset)
    init_parameters(ours, 2)
    init_parameters(hf, 2)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    for (name, a), b in zip(ours.state_dict().items(), hf.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 512, (1, 16))
    torch.testing.assert_close(ours(ids, labels=ids).loss, hf(input_ids=ids, labels=ids).loss)


def test_hf_compiles_fullgraph_with_aot_eager():
    torch._dynamo.reset()
    model = build_model("hf:tiny")
    b = make_batch(BATCHES["packed"], batch_size=2, seq_len=32, vocab_size=512, seed=0)
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(**b.model_kwargs())
    torch.testing.assert_close(out.loss, model(**b.model_kwargs()).loss)


def test_missing_transformers_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(ConfigError, match="needs HF transformers.*pip install"):
        build_model("hf:tiny")


@pytest.mark.parametrize(("name", "cls", "window"), [
    ("hf-mistral-w16:tiny", "MistralForCausalLM", 16),
    ("hf-qwen2-w16:tiny", "Qwen2ForCausalLM", 16),
    ("hf-mistral:tiny", "MistralForCausalLM", None),
])
def test_hf_mistral_and_qwen2_variants_with_sliding_windows(name, cls, window):
    model = build_model(name)
    assert type(model).__name__ == cls and model.config.sliding_window == window
    assert get_preset(name) == get_preset("tiny")
    if cls == "Qwen2ForCausalLM":  # the upper half of the layers slides
        assert model.config.layer_types == ["full_attention", "sliding_attention"]


def test_hf_mixtral_and_deepseek_v3_are_moe_and_mla_with_the_presets_sizes():
    mixtral, deepseek = build_model("hf-mixtral:tiny"), build_model("hf-deepseek-v3:tiny")
    assert type(mixtral).__name__ == "MixtralForCausalLM" and type(deepseek).__name__ == "DeepseekV3ForCausalLM"
    assert get_preset("hf-mixtral:tiny") == get_preset("hf-deepseek-v3:tiny") == get_preset("tiny")
    m = mixtral.config
    assert (m.num_local_experts, m.num_experts_per_tok, m.hidden_size, m.num_hidden_layers) == (4, 2, 64, 2)
    d = deepseek.config
    assert (d.q_lora_rank, d.kv_lora_rank, d.qk_rope_head_dim, d.qk_nope_head_dim, d.v_head_dim) == (32, 16, 8, 8, 16)
    assert (d.n_routed_experts, d.num_experts_per_tok, d.n_shared_experts, d.moe_intermediate_size) == (4, 2, 1, 44)
    assert deepseek.model.layers[1].mlp.experts is not None  # layer 0 dense, layer 1 routed experts
    # seeded like every model: same seed, same weights; each expert and latent projection drawn, not HF's init
    again = build_model("hf-deepseek-v3:tiny")
    for (name, a), b in zip(deepseek.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert deepseek.model.layers[1].self_attn.kv_a_proj_with_mqa.weight.std().item() == pytest.approx(0.02, rel=0.1)
    ids = torch.randint(0, 512, (1, 16))
    for model in (mixtral, deepseek):
        model(input_ids=ids, labels=ids).loss.backward()
        assert all(p.grad is not None for n, p in model.named_parameters() if "experts" in n or "_a_proj" in n)


def test_hf_deepseek_v32_is_deepseek_v3_with_an_indexer():
    model = build_model("hf-deepseek-v32:tiny")
    c = model.config
    assert type(model).__name__ == "DeepseekV32ForCausalLM" and get_preset("hf-deepseek-v32:tiny") == get_preset("tiny")
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.kv_lora_rank) == (2, 16, 256, 16)
    assert type(build_model("hf-deepseek-v3:tiny")).__name__ == "DeepseekV3ForCausalLM"  # not taken for v32


@pytest.mark.parametrize("model", ["hf-mixtral:tiny", "hf-deepseek-v3:tiny", "hf-deepseek-v32:tiny"])
def test_autosp_check_passes_on_the_moe_and_mla_harness_models(checks, model):
    """With the tiled loss: on MLA it once came out wrong (the key buffer's in-place fills were dead-code
    eliminated). The three share one launch (`checks`, tests/baselines/checking.py)."""
    checks.passed(_moe_and_mla(model))


def _moe_and_mla(model: str) -> RunConfig:
    return RunConfig(method="autosp", model=model, seq_len=128, world_size=2, compile_backend="aot_eager", zero=3,
                     tiling="loss", timeout_s=400)


#: each test that checks through `checks` (tests/baselines/checking.py): its configuration from its parameters
CONFIGS = {"test_autosp_check_passes_on_the_moe_and_mla_harness_models": _moe_and_mla}


@pytest.mark.parametrize("name", ["hf-gpt2:tiny", "hf-deepseek-v3-w16:tiny", "hf-mixtral:huge"])
def test_unknown_hf_family_is_a_config_error(name):
    with pytest.raises(ConfigError, match="unknown model"):
        get_preset(name)


def test_hf_qwen3_5_is_the_hybrid_of_gated_delta_nets_and_full_attention_at_the_presets_sizes():
    model = build_model("hf-qwen3.5:small")  # 4 layers: three gated delta-nets, then full attention
    c = model.config
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and get_preset("hf-qwen3.5:small") == get_preset("small")
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (c.linear_num_value_heads, c.linear_num_key_heads, c.linear_key_head_dim, c.hidden_size) == (8, 4, 16, 128)
    assert build_model("hf-qwen3.5:tiny").config.layer_types == ["linear_attention", "full_attention"]
    ids = torch.randint(0, 2048, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.layers[0].linear_attn.A_log.grad is not None
