"""A plain-PyTorch Llama decoder: the project's own model, written to be traced whole by torch.compile.

It mirrors HF transformers' LlamaForCausalLM (same module names, same math, the loss computed inside the
model with labels shifted there), so the compiler sees the graph a real HF training script would produce,
and `hf:<preset>` can be checked against it weight for weight.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autosp.compiler.sp.attention import masked_attention  # the `autosp_sp::masked_attention` op
from autosp.models.presets import ModelPreset

IGNORE_INDEX = -100


@dataclass
class CausalLMOutput:
    loss: Tensor | None
    logits: Tensor


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        # Normalise in fp32 whatever the model dtype, as HF does.
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    """cos/sin of the rotary angles for given positions; computed in forward so positions may be anything."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)  # [B, S, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads: [B, 1, S, head_dim]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


#: the attention core: (q [B, heads, S, head_dim], k, v [B, kv_heads, S, head_dim], mask or None) -> like q
AttentionFn = Callable[[Tensor, Tensor, Tensor, "Tensor | None"], Tensor]


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Causal SDPA, or SDPA under `mask` when one is given; GQA via enable_gqa (K/V keep the KV head count)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)


class LlamaAttention(nn.Module):
    """Projections + RoPE around a replaceable attention core: `attention_fn` (default `sdpa_attention`) is the
    hook hand-written sequence-parallel baselines use to wrap it (all-to-alls, a ring); the compiler sees SDPA."""

    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        self.num_heads = preset.num_attention_heads
        self.num_kv_heads = preset.num_key_value_heads
        self.head_dim = preset.head_dim
        d = preset.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.attention_fn: AttentionFn = sdpa_attention

    def forward(self, hidden_states: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        batch, seq_len, _ = hidden_states.shape
        # [B, S, heads * head_dim] -> [B, heads, S, head_dim]; K/V keep the KV head count (GQA in SDPA).
        q = self.q_proj(hidden_states).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = self.attention_fn(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class LlamaMLP(nn.Module):
    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(preset.hidden_size, preset.intermediate_size, bias=False)
        self.up_proj = nn.Linear(preset.hidden_size, preset.intermediate_size, bias=False)
        self.down_proj = nn.Linear(preset.intermediate_size, preset.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(preset)
        self.mlp = LlamaMLP(preset)
        self.input_layernorm = LlamaRMSNorm(preset.hidden_size, preset.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(preset.hidden_size, preset.rms_norm_eps)

    def forward(self, hidden_states: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin, mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


#: `build_attention_mask`'s mask as an `autosp_sp::masked_attention` program over `attention_mask_rows`:
#: (kv <= q) & (document[q] == document[kv]) & keep[kv]
ATTENTION_MASK_PROGRAM = json.dumps([["le", ["row", 1], ["row", 0]], ["eq", ["row", 2], ["row", 3]],
                                     ["and", ["step", 0], ["step", 1]], ["and", ["step", 2], ["row", 4]]])


def attention_mask_rows(position_ids: Tensor, attention_mask: Tensor | None) -> list[Tensor]:
    """The mask's O(S) inputs: query positions [S, 1], key positions [1, S], the document of each query
    [B, 1, S, 1] and key [B, 1, 1, S] (a document starts wherever position_ids is 0), keys kept [B, 1, 1, S]."""
    idx = torch.arange(position_ids.shape[-1], device=position_ids.device)
    document = torch.cumsum(position_ids == 0, dim=-1)[:, None]  # [B, 1, S]
    keep = torch.ones_like(document, dtype=torch.bool) if attention_mask is None else attention_mask.bool()[:, None]
    return [idx[:, None], idx[None, :], document[..., None], document[:, :, None, :], keep[:, :, None, :]]


def build_attention_mask(position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Boolean [B, 1, S, S] mask: causal AND same packed document AND key not padding (True = attend): the dense
    form of ATTENTION_MASK_PROGRAM, so packed rows never attend across documents."""
    q, kv, document_q, document_kv, keep = attention_mask_rows(position_ids, attention_mask)
    return (kv <= q) & (document_q == document_kv) & keep


def attention_from_mask_rows(q: Tensor, k: Tensor, v: Tensor, rows: list[Tensor] | None) -> Tensor:
    """`sdpa_attention` under `build_attention_mask`'s mask given as its rows (None: causal), never [S, S]:
    what a hand-written sequence-parallel attention uses on the full sequence."""
    if rows is None:
        return sdpa_attention(q, k, v, None)
    return masked_attention.masked_attention(q, k, v, rows, ATTENTION_MASK_PROGRAM, None, True)


class LlamaModel(nn.Module):
    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(preset.vocab_size, preset.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(preset) for _ in range(preset.num_layers))
        self.norm = LlamaRMSNorm(preset.hidden_size, preset.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(preset.head_dim, preset.rope_theta)
        # False when the attention core takes the full sequence's mask from elsewhere (hand-written SP baselines):
        # then no mask of the shard's own positions ([S/P, S/P]) is built and the core gets None.
        self.builds_mask = True

    def forward(
        self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask: Tensor | None = None
    ) -> Tensor:
        hidden_states = self.embed_tokens(input_ids)
        # Plain causal attention (is_causal=True, no O(S^2) mask) unless positions or padding say otherwise.
        needs_mask = self.builds_mask and (position_ids is not None or attention_mask is not None)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        position_ids = position_ids.expand(input_ids.shape[0], -1)
        mask = build_attention_mask(position_ids, attention_mask) if needs_mask else None
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin, mask)
        return self.norm(hidden_states)


def causal_lm_loss(logits: Tensor, labels: Tensor, num_items_in_batch: Tensor | int | None = None) -> Tensor:
    """HF transformers' ForCausalLMLoss: labels are shifted here, -100 is ignored, token mean (or sum / count)."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)
    shift_labels = labels[..., 1:].contiguous()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(
        logits.view(-1, logits.size(-1)),
        shift_labels.view(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


class LlamaForCausalLM(nn.Module):
    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        self.preset = preset
        self.model = LlamaModel(preset)
        self.lm_head = nn.Linear(preset.hidden_size, preset.vocab_size, bias=False)
        if preset.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        num_items_in_batch: Tensor | int | None = None,
    ) -> CausalLMOutput:
        hidden_states = self.model(input_ids, position_ids=position_ids, attention_mask=attention_mask)
        logits = self.lm_head(hidden_states)
        loss = None if labels is None else causal_lm_loss(logits, labels, num_items_in_batch)
        return CausalLMOutput(loss=loss, logits=logits)
