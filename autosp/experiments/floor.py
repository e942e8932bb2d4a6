"""Analytic lower bound of per-rank training memory: the "physical limit" a method's search is judged against.

A measured maximum trainable length says little on its own: is a method at 40% or at 95% of what its
sharding allows? This module computes, from the model's shape alone, the bytes one rank cannot avoid
holding at the peak of a training step, and from that the longest sequence that could fit a budget.

What is counted (all of it a true lower bound for the methods of this project):
- model state: parameters, gradients and AdamW's two moments (``exp_avg``, ``exp_avg_sq``, kept in the
  parameter dtype by torch.optim.AdamW), divided over the world size for methods that shard them
  (ZeRO-3 / FSDP) and replicated for the others (SP methods replicate the model);
- for sharding methods, the one unit it must gather whole to compute with (the largest of a decoder
  layer and the embedding);
- activations per local token: each decoder layer's input (what a full-recompute schedule still keeps:
  the minimum any backward needs) and the fp32 logits of the local tokens (the project's loss is HF's
  ``ForCausalLMLoss``, which materialises them) unless the loss is tiled (``tiled_loss``: AutoSP's
  ``--tiling loss`` keeps one tile of logits, a constant, so the term disappears).
Transient working buffers (attention scores, MLP intermediates, all-to-all buffers) are not counted: a
bound must hold for the best possible schedule, and those can be made arbitrarily short-lived.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, asdict

import torch

from autosp.harness.config import ConfigError
from autosp.models.presets import ModelPreset

FP32_BYTES = 4
ADAMW_STATES_PER_PARAM = 2  # exp_avg and exp_avg_sq


@dataclass(frozen=True)
class MethodSharding:
    """The two facts about a method that decide its memory floor."""

    shards_model_state: bool  # params, grads and AdamW states divided over the world size
    splits_sequence: bool  # each rank keeps the activations of only S / world_size tokens


#: Per-method sharding facts, keyed by `--method` name.
METHOD_SHARDING: dict[str, MethodSharding] = {
    "single": MethodSharding(shards_model_state=False, splits_sequence=False),
    "autosp": MethodSharding(shards_model_state=False, splits_sequence=True),
    "ulysses": MethodSharding(shards_model_state=False, splits_sequence=True),
    "ulysses-ac": MethodSharding(shards_model_state=False, splits_sequence=True),
    "ulysses-compile": MethodSharding(shards_model_state=False, splits_sequence=True),
    "ring": MethodSharding(shards_model_state=False, splits_sequence=True),
    # DeepSpeed's AutoSP runs with ZeRO stage 0/1 only; with sp == world size ZeRO-1 has no DP group to shard over.
    "ds-autosp": MethodSharding(shards_model_state=False, splits_sequence=True),
    "zero3": MethodSharding(shards_model_state=True, splits_sequence=False),
    "fsdp": MethodSharding(shards_model_state=True, splits_sequence=False),
}


@dataclass(frozen=True)
class MemoryFloor:
    """Per-rank bytes a method cannot avoid: a constant part and a part linear in the sequence length."""

    method: str
    model: str
    world_size: int
    parameter_count: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    gathered_unit_bytes: int
    activation_bytes_per_token: int  # per token kept on this rank
    tokens_per_rank_per_seq_token: float  # batch_size / sequence split

    @property
    def static_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.gathered_unit_bytes

    def bytes_at(self, seq_len: int) -> float:
        """Lower bound of one rank's peak bytes when training at `seq_len`."""
        return self.static_bytes + self.activation_bytes_per_token * self.tokens_per_rank_per_seq_token * seq_len

    def max_seq_len(self, budget_bytes: int, granularity: int = 1) -> int:
        """Longest multiple of `granularity` whose floor fits `budget_bytes` (0 when not even the model fits)."""
        room = budget_bytes - self.static_bytes
        if room <= 0:
            return 0
        exact = room / (self.activation_bytes_per_token * self.tokens_per_rank_per_seq_token)
        return int(math.floor(exact / granularity)) * granularity

    def to_dict(self) -> dict:
        return {**asdict(self), "static_bytes": self.static_bytes}


def sharding_of(method: str) -> MethodSharding:
    if method not in METHOD_SHARDING:
        raise ConfigError(
            f"no memory-floor entry for method {method!r}; add it to autosp.experiments.floor.METHOD_SHARDING "
            f"(known: {', '.join(sorted(METHOD_SHARDING))})"
        )
    return METHOD_SHARDING[method]


def layer_parameter_count(preset: ModelPreset) -> int:
    """Parameters of one decoder layer: attention projections (GQA), SwiGLU MLP, two RMSNorm weights."""
    d = preset.hidden_size
    head_dim = d // preset.num_attention_heads
    kv = preset.num_key_value_heads * head_dim
    attention = d * d + 2 * d * kv + d * d  # q, k, v, o (no biases in Llama)
    mlp = 3 * d * preset.intermediate_size  # gate, up, down
    return attention + mlp + 2 * d


def parameter_count(preset: ModelPreset) -> int:
    """All parameters: embedding, layers, final norm, and the LM head unless tied to the embedding."""
    embedding = preset.vocab_size * preset.hidden_size
    head = 0 if preset.tie_word_embeddings else embedding
    return embedding + preset.num_layers * layer_parameter_count(preset) + preset.hidden_size + head


def memory_floor(
    method: str,
    preset: ModelPreset,
    *,
    world_size: int,
    batch_size: int = 1,
    dtype: str = "float32",
    model_name: str | None = None,
    tiled_loss: bool = False,
) -> MemoryFloor:
    """The floor of `method` training `preset` on `world_size` ranks (batch_size sequences per replica);
    `tiled_loss`: the LM head and loss run over token tiles, so no logits scale with the sequence."""
    sharding = sharding_of(method)
    if world_size < 1 or batch_size < 1:
        raise ConfigError(f"world_size ({world_size}) and batch_size ({batch_size}) must be >= 1")
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    n = parameter_count(preset)
    shard = world_size if sharding.shards_model_state else 1
    per_rank_params = math.ceil(n / shard)
    unit = max(layer_parameter_count(preset), preset.vocab_size * preset.hidden_size)
    split = world_size if sharding.splits_sequence else 1
    return MemoryFloor(
        method=method,
        model=model_name or getattr(preset, "name", "?"),
        world_size=world_size,
        parameter_count=n,
        params_bytes=per_rank_params * elem,
        grads_bytes=per_rank_params * elem,
        optimizer_bytes=ADAMW_STATES_PER_PARAM * per_rank_params * elem,
        gathered_unit_bytes=unit * elem if sharding.shards_model_state else 0,
        activation_bytes_per_token=preset.num_layers * preset.hidden_size * elem
        + (0 if tiled_loss else preset.vocab_size * FP32_BYTES),
        tokens_per_rank_per_seq_token=batch_size / split,
    )


def floor_for(method: str, model: str, *, world_size: int, batch_size: int = 1, dtype: str = "float32",
              tiled_loss: bool = False) -> MemoryFloor:
    """`memory_floor` for a model given by name (`tiny`, `llama-3.1-8b`, `hf:small`, ...)."""
    from autosp.models import get_preset

    return memory_floor(
        method, get_preset(model), world_size=world_size, batch_size=batch_size, dtype=dtype, model_name=model,
        tiled_loss=tiled_loss,
    )
