"""Unmodified HF transformers models people train now, from tiny seeded configs (2 layers, hidden 64, no download),
with their default attention and experts implementations unless a family's entry says otherwise."""
from __future__ import annotations

import torch
from torch import nn

COMMON = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, use_cache=False, pad_token_id=0, eos_token_id=1, bos_token_id=1)
_MOE = dict(num_experts_per_tok=2)
_MLA = dict(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32,
            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, n_group=1, topk_group=1, **_MOE)

# hc_sinkhorn_iters=2: the hyper-connections' Sinkhorn loop traced with its body once (HF's default 20 unrolls it 19
# times in each of a layer's two hyper-connections: per token, over its 2 x 2 mixing matrix, nothing along the
# sequence); the same ops in a graph compiled in about half the CPU (docs/measurements/2026-12-06-suite-b.md)
V4 = dict(num_key_value_heads=1, head_dim=16, q_lora_rank=32, moe_intermediate_size=32, n_routed_experts=4,
           sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=2,
           hc_sinkhorn_iters=2,
           compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, **_MOE)

#: family -> (model class, config class, config overrides, from_config keywords)
FAMILIES: dict[str, tuple[str, str, dict, dict]] = {
    # the load-balancing loss as people train it (output_router_logits), weighted so an error in it shows
    "mixtral-aux": ("MixtralForCausalLM", "MixtralConfig",
                    dict(num_local_experts=4, output_router_logits=True, router_aux_loss_coef=1.0, **_MOE), {}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, **_MOE), {}),
    "mixtral-eager-experts": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, **_MOE),
                              dict(experts_implementation="eager")),
    # the fix the eager loop's refusal names: HF's static-shape batched experts
    "mixtral-batched-mm": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, **_MOE),
                           dict(experts_implementation="batched_mm")),
    "qwen2-moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",  # a shared expert beside the routed ones
                  dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **_MOE), {}),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=4, **_MOE), {}),
    # multi-head latent attention (latent q/kv projections, split rope/no-rope head dims, keys copied into a
    # fresh buffer) and routed + shared experts after one dense layer
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", _MLA, {}),
    # DeepSeek sparse attention: V3's MLA and MoE, and a lightning indexer (2 heads of 16) keeping 8 keys per query;
    # GLM-MoE-DSA the same with interleaved indexer rope, its second layer reusing the first one's selection
    "deepseek-v32": ("DeepseekV32ForCausalLM", "DeepseekV32Config",
                     dict(_MLA, index_topk=8, index_head_dim=16, index_n_heads=2), {}),
    "glm-moe-dsa": ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig",
                    dict(_MLA, index_topk=8, index_head_dim=16, index_n_heads=2, indexer_types=["full", "shared"]),
                    {}),
    # DeepSeek-V4 with sliding-window layers (sinks, eager attention), hyper-connections, hash routing by token id
    # (`tid2eid[input_ids]`, a random table here: HF initialises it to zeros) in both layers
    "deepseek-v4": ("DeepseekV4ForCausalLM", "DeepseekV4Config", dict(V4, layer_types=["sliding_attention"] * 2), {}),
    "deepseek-v4-batched-mm": ("DeepseekV4ForCausalLM", "DeepseekV4Config",
                               dict(V4, layer_types=["sliding_attention"] * 2),
                               dict(experts_implementation="batched_mm")),
    # its compressed layers: compressed sparse attention (keys pooled over overlapping windows of 4, a lightning
    # indexer keeping 4 of them per query) and heavily compressed attention (windows of 8), each joined to the
    # sliding window's keys
    "deepseek-v4-compressed": ("DeepseekV4ForCausalLM", "DeepseekV4Config",
                               dict(V4, layer_types=["compressed_sparse_attention", "heavily_compressed_attention"]),
                               {}),
    # attention sinks (per-head logits joining the softmax, eager attention) and alternating sliding windows
    "gpt-oss": ("GptOssForCausalLM", "GptOssConfig",
                dict(num_local_experts=4, head_dim=16, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"], **_MOE), {}),
    # the same through HF's flex attention (the sinks as a score modification of flex_attention)
    "gpt-oss-flex": ("GptOssForCausalLM", "GptOssConfig",
                     dict(num_local_experts=4, head_dim=16, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"], **_MOE),
                     dict(attn_implementation="flex_attention")),
    # a sink gate after the attention, sigmoid(logsumexp(scores) - sink) per head and query (eager attention, HF's
    # default for these), alternating sliding windows; Granite-MoE's experts
    "granite-swa": ("GraniteSWAForCausalLM", "GraniteSWAConfig",
                    dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]), {}),
    "granitemoe-swa": ("GraniteMoeSWAForCausalLM", "GraniteMoeSWAConfig",
                       dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                            num_local_experts=4, **_MOE), {}),
    # plain Llama (HF's default attention: SDPA), and through HF's flex attention (build_hf_flex: its backward
    # allowed on CPU)
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}, {}),
    "llama-flex": ("LlamaForCausalLM", "LlamaConfig", {}, dict(attn_implementation="flex_attention")),
    # Mistral's sliding window (8 tokens) as HF's flex mask_mod
    "mistral-flex": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=8),
                     dict(attn_implementation="flex_attention")),
    # chunked local attention, a NoPE layer, every token through every expert (the router's `repeat`) + shared
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig",
               dict(num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1, intermediate_size_mlp=64,
                    attention_chunk_size=8, no_rope_layers=[1, 0], layer_types=["chunked_attention", "full_attention"],
                    head_dim=16), {}),
    # rope scaling: Llama 3.1's frequency bands, YaRN's (attention factor 1.14: cos/sin scaled in the graph)
    "llama3-rope": ("LlamaForCausalLM", "LlamaConfig",
                    dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                          "rope_theta": 500000.0}), {}),
    "llama-yarn": ("LlamaForCausalLM", "LlamaConfig",
                   dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                         "rope_theta": 10000.0}), {}),
    # LongRoPE: the long factors past 16 positions (the rope reads max(position_ids) + 1 in the graph)
    "phi3-longrope": ("Phi3ForCausalLM", "Phi3Config",
                      dict(original_max_position_embeddings=16, max_position_embeddings=64,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "short_factor": [1.0 + i / 8 for i in range(8)],
                                            "long_factor": [2.0 + i / 4 for i in range(8)]}), {}),
    # short causal convolutions (a halo from the previous rank) beside full attention; LFM2-MoE's first layer dense
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config", dict(layer_types=["conv", "full_attention"]), {}),
    # LFM3: its short convolution (kernel 7), sliding-window and full attention with an output gate, sandwich norms
    "lfm3": ("Lfm3ForCausalLM", "Lfm3Config",
             dict(layer_types=["conv", "sliding_attention", "full_attention"], num_hidden_layers=3, head_dim=16,
                  sliding_window=8), {}),
    "lfm2-moe": ("Lfm2MoeForCausalLM", "Lfm2MoeConfig",
                 dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3, num_dense_layers=1,
                      num_experts=4, moe_intermediate_size=32, **_MOE), {}),
    # gated delta-net linear attention (its short convolution, then the gated delta rule) beside full attention,
    # MoE with a shared expert; Qwen3.5 dense
    "qwen3-next": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
                   dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                        layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, head_dim=16, **_MOE),
                   {}),
    "qwen3.5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
                dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                     linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, head_dim=16), {}),
    # Qwen3.5-MoE (its experts and shared expert) and OLMo hybrid: the same gated delta-net beside full attention
    "qwen3.5-moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
                    dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                         linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, head_dim=16,
                         num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **_MOE), {}),
    "olmo-hybrid": ("OlmoHybridForCausalLM", "OlmoHybridConfig",
                    dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                         linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16), {}),
    # Mamba2 / SSD layers (their short convolution, then the chunked selective scan; chunks of 8 tokens so a shard
    # holds several): Mamba2 alone (no attention at all), Bamba and Falcon-H1 beside attention, GraniteMoeHybrid and
    # Nemotron-H with their experts (Nemotron-H: mamba, attention, MoE layers)
    "mamba2": ("Mamba2ForCausalLM", "Mamba2Config",
               dict(num_heads=8, head_dim=16, state_size=16, n_groups=2, expand=2, chunk_size=8), {}),
    "bamba": ("BambaForCausalLM", "BambaConfig",
              dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
                   mamba_chunk_size=8), {}),
    "falcon-h1": ("FalconH1ForCausalLM", "FalconH1Config",
                  dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_ssm=128,
                       mamba_chunk_size=8, head_dim=16), {}),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                         dict(layer_types=["mamba", "attention"], num_local_experts=4, shared_intermediate_size=32,
                              mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
                              mamba_chunk_size=8, **_MOE), {}),
    "nemotron-h": ("NemotronHForCausalLM", "NemotronHConfig",
                   dict(layers_block_type=["mamba", "attention", "moe"], num_hidden_layers=3, head_dim=16,
                        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=8,
                        n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32,
                        moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1, **_MOE), {}),
    # Mamba1's selective scan (a per channel x state decay, `mamba_selective_scan`) beside attention and experts
    "jamba": ("JambaForCausalLM", "JambaConfig",
              dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                   num_experts=4, mamba_d_state=16, mamba_dt_rank=8, use_mamba_kernels=False, **_MOE), {}),
    # Mamba1 alone (Mamba; FalconMamba with its RMS norms on B, C and dt): the selective scan without attention
    "mamba": ("MambaForCausalLM", "MambaConfig", dict(state_size=16, expand=2, time_step_rank=8), {}),
    "falcon-mamba": ("FalconMambaForCausalLM", "FalconMambaConfig", dict(state_size=16, expand=2, time_step_rank=8),
                     {}),
    # Zamba2: Mamba2 layers and a hybrid layer (a shared attention + MLP block, fed the embeddings, before its mamba)
    "zamba2": ("Zamba2ForCausalLM", "Zamba2Config",
               dict(layers_block_type=["mamba", "hybrid"], n_mamba_heads=8, mamba_d_state=16, mamba_ngroups=2,
                    chunk_size=8, use_mamba_kernels=False, adapter_rank=8), {}),
    # Kimi delta attention (a per-channel gated delta rule, `chunk_kimi_delta_attention`) beside MLA
    "kimi-linear": ("KimiLinearForCausalLM", "KimiLinearConfig",
                    dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "dense"],
                         linear_head_dim=16, linear_num_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                         q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16), {}),
    # lightning attention (MiniMax: a block-wise linear attention with a decayed carried state, blocks of 8 so a shard
    # holds several) beside attention and experts
    "minimax": ("MiniMaxForCausalLM", "MiniMaxConfig",
                dict(layer_types=["linear_attention", "full_attention"], num_local_experts=4, head_dim=16, block_size=8,
                     **_MOE), {}),
}


def build_hf(family: str, seed: int = 0, dtype: str = "float32") -> nn.Module:
    """The family's tiny model, seeded, its parameters in `dtype` ("bfloat16": as people train it)."""
    import transformers

    model_class, config_class, overrides, keywords = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**COMMON, **overrides})
    model = getattr(transformers, model_class)._from_config(config, **keywords).train()
    for name, table in model.named_buffers():  # hash routing's token -> experts table: zeros until a checkpoint
        if name.endswith("tid2eid"):
            table.copy_(torch.randint(0, config.n_routed_experts, table.shape,
                                      generator=torch.Generator().manual_seed(seed)))
    return model.to(getattr(torch, dtype))


def build_hf_flex(family: str, seed: int = 0) -> nn.Module:
    """`build_hf`, with torch's up-front refusal of flex attention's backward on CPU lifted (its dense math backward
    exists), so the graph reaches AutoSP's pass as it would on a GPU. Outside a compiled graph (the single-process
    reference) HF runs flex attention through `torch.compile(flex_attention)`, which Inductor fails to build on CPU
    (IndexError, torch 2.13): the reference calls it uncompiled instead, torch's exact unfused math."""
    import torch.nn.attention.flex_attention as flex
    from transformers.integrations import flex_attention as hf_flex

    from tests.compiler.models import allow_flex_backward_on_cpu

    allow_flex_backward_on_cpu()
    hf_flex.WrappedFlexAttention.__call__ = lambda self: flex.flex_attention
    return build_hf(family, seed)
