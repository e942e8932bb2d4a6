"""Small hand-written decoders for SP-pass tests: one model, parameterised by the pattern under test
(SDPA, hand-written attention with logit soft-capping, flex attention with head-dependent mods, a logging call in
forward, residual dropout)."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
log = logging.getLogger("tests.compiler.models")


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    attention: str = "sdpa"  # sdpa | eager (matmul -> scale -> [soft-cap] -> mask -> softmax -> dropout -> matmul)
    # | flex (flex_attention: learned alibi slopes read in score_mod and a causal window of 8 * (h + 1) keys,
    # both per head `h`)
    flex_sinks: bool = False  # flex: per-head sink logits applied through its logsumexp (HF's gpt-oss on GPUs)
    softcap: float | None = None
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    log_in_forward: bool = False
    experts: int = 0  # > 0: a mixture-of-experts MLP with top_k routing
    top_k: int = 2


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """HF's repeat_kv: [B, KV, S, D] -> [B, KV * groups, S, D] through expand + reshape."""
    b, kv, s, d = x.shape
    return x if groups == 1 else x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.dim // cfg.heads
        self.q_proj = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)
        if cfg.attention == "flex":
            self.slopes = nn.Parameter(torch.exp2(-1.0 - torch.arange(cfg.heads)))
        if cfg.flex_sinks:
            self.sinks = nn.Parameter(torch.randn(cfg.heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.cfg.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif self.cfg.attention == "flex":
            out = self._flex(q, k, v)
        else:
            out = self._eager(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def _flex(self, q, k, v):
        """Head-dependent score_mod and mask_mod, the block mask built per head in forward (as HF builds its own)."""
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

        def alibi(score, b, h, q_idx, kv_idx):
            return score - (kv_idx - q_idx).abs() * self.slopes[h]

        def window(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < 8 * (h + 1))

        s = q.shape[-2]
        mask = create_block_mask(window, B=None, H=self.cfg.heads, Q_LEN=s, KV_LEN=s, device=q.device)
        if not self.cfg.flex_sinks:
            return flex_attention(q, k, v, score_mod=alibi, block_mask=mask, enable_gqa=True)
        out, aux = flex_attention(q, k, v, score_mod=alibi, block_mask=mask, enable_gqa=True,
                                  return_aux=AuxRequest(lse=True))
        return out * torch.sigmoid(aux.lse - self.sinks[:, None])[..., None]  # a sink logit joins the softmax

    def _eager(self, q, k, v):
        groups = self.cfg.heads // self.cfg.kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(self.head_dim))
        if self.cfg.softcap is not None:
            scores = torch.tanh(scores / self.cfg.softcap) * self.cfg.softcap
        s = q.shape[-2]
        causal = torch.full((s, s), float("-inf"), device=q.device).triu(1)
        scores = scores + causal[None, None]
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, p=self.cfg.attention_dropout, training=self.training)
        return torch.matmul(probs, v)


class MixtureOfExperts(nn.Module):
    """Dropless top-k MoE, routed the way Mixtral/Qwen-MoE kernels do with static shapes: sort the (token, expert)
    pairs by expert, gather the tokens (`tokens[order // top_k]`), run each pair's expert, add the results back."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(cfg.experts, cfg.dim, 2 * cfg.dim) * 0.1)
        self.w_out = nn.Parameter(torch.randn(cfg.experts, 2 * cfg.dim, cfg.dim) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, experts = F.softmax(self.gate(tokens), dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        routed = tokens.repeat_interleave(self.top_k, dim=0)[order]  # == tokens[order // top_k]
        h = F.gelu(torch.bmm(routed[:, None], self.w_in[flat[order]]))
        h = torch.bmm(h, self.w_out[flat[order]]).squeeze(1) * weights.reshape(-1)[order][:, None]
        return torch.zeros_like(tokens).index_add_(0, order // self.top_k, h).view_as(x)


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp = MixtureOfExperts(cfg) if cfg.experts else nn.Sequential(
            nn.Linear(cfg.dim, 2 * cfg.dim), nn.GELU(), nn.Linear(2 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.norm1(x)), p=self.cfg.residual_dropout, training=self.training)
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """Token + learned position embeddings, pre-norm blocks, HF-style shifted causal LM loss (token mean)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(1024, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.cfg.log_in_forward:
            log.warning("Decoder.forward on %d tokens", input_ids.shape[1])
        h = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))[None]
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.norm(h)).float()
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE_INDEX)


def allow_flex_backward_on_cpu() -> None:
    """Lift torch's up-front refusal of flex attention's backward on CPU (its dense math backward exists), so a
    flex model trains here as it would on a GPU."""
    import torch.nn.attention.flex_attention as flex

    refuse = getattr(flex._validate_device, "refuse", flex._validate_device)

    def validate_off_cpu(query, key, value):
        if query.device.type != "cpu":
            refuse(query, key, value)

    validate_off_cpu.refuse = refuse
    flex._validate_device = validate_off_cpu


def build_decoder(seed: int = 0, **options) -> Decoder:
    if options.get("attention") == "flex":
        allow_flex_backward_on_cpu()
    torch.manual_seed(seed)
    return Decoder(DecoderConfig(**options)).train()


def build_hf_gemma2(seed: int = 0) -> nn.Module:
    """Unmodified HF Gemma2 with eager attention: logit soft-capping (attention and final), HF's own masks."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, sliding_window=16, use_cache=False)
    return Gemma2ForCausalLM._from_config(cfg, attn_implementation="eager").train()


def build_hf_qwen3_moe(seed: int = 0) -> nn.Module:
    """Unmodified HF Qwen3-MoE (top-2 of 4 experts in every layer), experts run as HF's static-shape `batched_mm`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], use_cache=False)
    return Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="sdpa",
                                            experts_implementation="batched_mm").train()
