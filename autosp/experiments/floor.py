"""Analytic lower bound of per-rank training memory: the "physical limit" a method's search is judged against.

A measured maximum trainable length says little on its own: is a method at 40% or at 95% of what its
sharding allows? This module computes, from the model's shape alone, the bytes one rank cannot avoid
holding at the peak of a training step, and from that the longest sequence that could fit a budget.

What is counted (all of it a true lower bound for the methods of this project):
- model state: parameters, gradients and AdamW's two moments (``exp_avg``, ``exp_avg_sq``, kept in the
  parameter dtype by torch.optim.AdamW), divided over the world size as the method's ZeRO stage says: stage 0
  replicates everything, 1 shards the moments, 2 also the gradients and the stored (master) parameters, 3 also
  the parameters used for compute (zero3/fsdp run stage 3; autosp any stage; the other SP methods stage 0);
- the parameters held whole for compute beyond the stored copy: at stage 3 the one unit gathered at a time
  (the largest of a decoder layer and the embedding); at stage 2 the whole gathered model, kept from forward to
  backward; under mixed precision at stages 0-2 the compute-dtype copy of the whole model;
- precision: pure (everything in `dtype`, `--dtype bfloat16-pure`) or mixed (`mixed_precision=True`, `--dtype
  bfloat16`: fp32 master parameters, fp32 gradients and fp32 AdamW moments, compute and communication in `dtype`);
- activations per local token: each decoder layer's input (what a full-recompute schedule still keeps:
  the minimum any backward needs) and the fp32 logits of the local tokens (the project's loss is HF's
  ``ForCausalLMLoss``, which materialises them) unless the loss is tiled (``tiled_loss``: AutoSP's
  ``--tiling loss`` keeps one tile of logits, a constant, so the term disappears). With ``offload``
  (``--offload activations``) the layer inputs wait in host memory: the device keeps ``DEVICE_WINDOW`` of
  them (the one backward uses: a reload issued late, after the previous one's last use, never has two there; the
  planner issues them so where that is what fits), the rest is counted apart as host bytes.
Transient working buffers (attention scores, MLP intermediates, all-to-all buffers) are not counted: a
bound must hold for the best possible schedule, and those can be made arbitrarily short-lived.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from autosp.compiler.memory import DEVICE_WINDOW
from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.precision import precision_of
from autosp.models.presets import ModelPreset

if TYPE_CHECKING:
    import argparse

    import pandas as pd

FP32_BYTES = 4
ADAMW_STATES_PER_PARAM = 2  # exp_avg and exp_avg_sq


@dataclass(frozen=True)
class MethodSharding:
    """The two facts about a method that decide its memory floor."""

    zero_stages: tuple[int, ...]  # ZeRO stages it runs (as its `zero_stages` in baselines/); the first by default
    splits_sequence: bool  # each rank keeps the activations of only S / world_size tokens

    @property
    def shards_model_state(self) -> bool:
        """At its default stage, params, grads and AdamW states are all divided over the world size."""
        return self.zero_stages[0] == 3


#: Per-method sharding facts, keyed by `--method` name.
METHOD_SHARDING: dict[str, MethodSharding] = {
    "single": MethodSharding(zero_stages=(0,), splits_sequence=False),
    "autosp": MethodSharding(zero_stages=(3, 0, 1, 2), splits_sequence=True),
    "ulysses": MethodSharding(zero_stages=(3, 0), splits_sequence=True),
    "ulysses-compile": MethodSharding(zero_stages=(0,), splits_sequence=True),
    "ring": MethodSharding(zero_stages=(3, 0), splits_sequence=True),
    # DeepSpeed's AutoSP runs with ZeRO stage 0/1 only; with sp == world size ZeRO-1 has no DP group to shard over.
    "ds-autosp": MethodSharding(zero_stages=(0,), splits_sequence=True),
    "zero3": MethodSharding(zero_stages=(3,), splits_sequence=False),
    "fsdp": MethodSharding(zero_stages=(3,), splits_sequence=False),
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
    zero: int = 0  # the ZeRO stage of the model state
    precision: str = "float32"  # the dtype (pure) or "<dtype>-mixed" (fp32 master, gradients, moments)
    host_bytes_per_token: int = 0  # offloaded layer inputs per token kept on this rank, in host memory
    host_state_bytes: int = 0  # offload=optimizer: masters, gradient buffers and AdamW moments in host memory

    def host_bytes_at(self, seq_len: int) -> float:
        """Host memory of one rank's offloaded activations at `seq_len` (apart from `bytes_at`)."""
        return self.host_bytes_per_token * self.tokens_per_rank_per_seq_token * seq_len

    @property
    def model_state_bytes(self) -> int:
        """Parameters (stored and gathered/compute copies), gradients and AdamW moments on this rank."""
        return self.static_bytes

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
    zero: int | None = None,
    mixed_precision: bool = False,
    tiled_loss: bool = False,
    offload: bool = False,
    optimizer_offload: bool = False,
    params_offload: bool = False,
) -> MemoryFloor:
    """The floor of `method` training `preset` on `world_size` ranks (batch_size sequences per replica) at ZeRO
    stage `zero` (default: the method's own) in `dtype`, pure or mixed (fp32 master state, `dtype` compute);
    `tiled_loss`: the LM head and loss run over token tiles, so no logits scale with the sequence.
    `offload`: the layer inputs wait in host memory but for `DEVICE_WINDOW` of them (`host_bytes_per_token`).
    `optimizer_offload` (`--offload optimizer`, `autosp.comm.host_optimizer`): masters, a gradient buffer and the
    moments of every element this rank steps in host memory (`host_state_bytes`); the device keeps the parameters
    and gradients in the compute dtype and no moments. `params_offload` (`--offload ...,params`,
    `autosp.comm.host_params`): those parameters and gradients in host memory too, the device holding one unit
    fetched (as ZeRO 3's gathered unit)."""
    sharding = sharding_of(method)
    if world_size < 1 or batch_size < 1:
        raise ConfigError(f"world_size ({world_size}) and batch_size ({batch_size}) must be >= 1")
    stage = sharding.zero_stages[0] if zero is None else zero
    if stage not in sharding.zero_stages:
        raise ConfigError(f"--method {method} runs ZeRO stage(s) {sorted(sharding.zero_stages)}, not {stage}")
    compute = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    if mixed_precision and compute >= FP32_BYTES:
        raise ConfigError(f"mixed precision computes in a 16-bit dtype (bfloat16 or float16), not {dtype}")
    master = FP32_BYTES if mixed_precision else compute  # stored parameters, gradients and moments
    n = parameter_count(preset)
    sharded = math.ceil(n / world_size)
    unit = max(layer_parameter_count(preset), preset.vocab_size * preset.hidden_size)
    # parameters held whole for compute beyond the stored copy (see the module docstring)
    if stage == 3 or params_offload:
        gathered = unit
    elif stage == 2 or (mixed_precision and not optimizer_offload):  # offloaded: the device copy is the cast
        gathered = n
    else:
        gathered = 0
    stored = compute if optimizer_offload else master  # the device's parameters and gradients
    stepped = sharded if stage >= 1 else n
    kept = 0 if params_offload else (sharded if stage >= 2 else n) * stored  # parameters (or gradients) on the device
    split = world_size if sharding.splits_sequence else 1
    layer_input = preset.hidden_size * compute
    on_device = min(preset.num_layers, DEVICE_WINDOW) if offload else preset.num_layers
    return MemoryFloor(
        method=method,
        model=model_name or getattr(preset, "name", "?"),
        world_size=world_size,
        parameter_count=n,
        params_bytes=kept,
        grads_bytes=kept,
        optimizer_bytes=0 if optimizer_offload else ADAMW_STATES_PER_PARAM * stepped * master,
        gathered_unit_bytes=gathered * compute,
        activation_bytes_per_token=on_device * layer_input + (0 if tiled_loss else preset.vocab_size * FP32_BYTES),
        tokens_per_rank_per_seq_token=batch_size / split,
        zero=stage,
        precision=f"{dtype}-mixed" if mixed_precision else dtype,
        host_bytes_per_token=(preset.num_layers - on_device) * layer_input,
        host_state_bytes=((2 + ADAMW_STATES_PER_PARAM) * stepped * master if optimizer_offload else 0)
        + (2 * stepped * stored if params_offload else 0),
    )


def floor_for(method: str, model: str, *, world_size: int, batch_size: int = 1, dtype: str = "float32",
              zero: int | None = None, mixed_precision: bool | None = None, tiled_loss: bool = False,
              offload: bool = False, optimizer_offload: bool = False, params_offload: bool = False) -> MemoryFloor:
    """`memory_floor` for a model given by name (`tiny`, `llama-3.1-8b`, `hf:small`, ...). `dtype` is a run's
    `--dtype` (`bfloat16` = mixed, `bfloat16-pure`, ...: what a record or RunConfig holds) unless
    `mixed_precision` is given, which makes `dtype` the compute dtype."""
    from autosp.models import get_preset

    if mixed_precision is None:
        precision = precision_of(dtype)
        dtype, mixed_precision = str(precision.compute).removeprefix("torch."), precision.mixed
    return memory_floor(method, get_preset(model), world_size=world_size, batch_size=batch_size, dtype=dtype,
                        model_name=model, zero=zero, mixed_precision=mixed_precision, tiled_loss=tiled_loss,
                        offload=offload, optimizer_offload=optimizer_offload, params_offload=params_offload)


def run_floor(cfg: RunConfig) -> MemoryFloor:
    """The floor of the run `cfg` configures: at the ZeRO stage its strategy really runs (`Strategy.zero_stage`,
    e.g. ds-autosp's 1 under mixed bf16), with autosp's tiled loss and offload as set (what a search starts
    from and judges its answer against)."""
    from autosp.compiler.memory import OffloadPlan
    from autosp.compiler.tiling import parse_tiling
    from autosp.harness.strategy import get_strategy

    autosp = cfg.method == "autosp"
    plan = OffloadPlan.parse(cfg.offload) if autosp else OffloadPlan.parse("off")
    return floor_for(cfg.method, cfg.model, world_size=cfg.world_size, batch_size=cfg.batch_size, dtype=cfg.dtype,
                     zero=get_strategy(cfg.method).zero_stage(cfg), tiled_loss=autosp and parse_tiling(cfg.tiling).loss,
                     offload=plan.activations == "on", optimizer_offload=plan.optimizer == "on",
                     params_offload=plan.params == "on")


# ------------------------------------------------------------------------------------------ `autosp floor`

GIB = 1 << 30
#: the paper's trainability claims this table is read against: (baseline method here, claims.csv claim_id)
PAPER_RATIOS = (("zero3", "trainability_vs_zero3"), ("ulysses", "trainability_vs_ulysses_nvidia"))


def parse_entry(text: str) -> tuple[str, int | None]:
    """`autosp:3` -> ("autosp", 3); `zero3` -> ("zero3", None) (the method's own stage)."""
    method, _, stage = text.partition(":")
    if stage and not stage.isdigit():
        raise ConfigError(f"--methods entry {text!r}: write METHOD or METHOD:STAGE, e.g. autosp:3")
    return method, int(stage) if stage else None


def floor_table(models: list[str], entries: list[tuple[str, int | None]], *, world_size: int, budget_bytes: int,
                dtype: str = "bfloat16", mixed_precision: bool = True) -> pd.DataFrame:
    """One row per (model, method, stage): model state per rank, the longest length whose floor fits
    `budget_bytes`, and its ratio to each PAPER_RATIOS baseline at the row's stage where the baseline runs it
    (like with like), else at the baseline's own stage."""
    import pandas as pd

    rows = []
    for model in models:
        def limit(method: str, zero: int | None, model: str = model) -> tuple[MemoryFloor, int]:
            f = floor_for(method, model, world_size=world_size, dtype=dtype, zero=zero, mixed_precision=mixed_precision)
            return f, f.max_seq_len(budget_bytes)

        for method, zero in entries:
            f, length = limit(method, zero)
            baselines = {name: limit(name, f.zero if f.zero in sharding_of(name).zero_stages else None)[1]
                         for name, _ in PAPER_RATIOS}
            row = {"model": model, "method": method, "zero": f.zero, "precision": f.precision,
                   "model_state_gib": f.static_bytes / GIB,
                   "kib_per_seq_token": f.activation_bytes_per_token * f.tokens_per_rank_per_seq_token / 1024,
                   "max_seq_len": length}
            for name, _ in PAPER_RATIOS:
                row[f"vs_{name}"] = (length / baselines[name] if baselines[name]
                                      else float("inf") if length else float("nan"))
            rows.append(row)
    return pd.DataFrame(rows)


def format_floor_table(df: pd.DataFrame, *, world_size: int, budget_bytes: int) -> str:
    from autosp.experiments.tables import paper_claims

    claims = paper_claims().set_index("claim_id")
    head = (f"analytic floor, {world_size} ranks x {budget_bytes / GIB:.0f} GiB: longest trainable sequence "
            "(model state + one decoder-layer input per token + fp32 logits; a lower bound on memory)")
    body = df.to_string(index=False, float_format=lambda v: f"{v:.2f}")
    paper = "paper claims: " + "; ".join(
        f"autosp vs {claims.loc[cid, 'autosp_vs']} {claims.loc[cid, 'factor']}x ({claims.loc[cid, 'model']})"
        for _, cid in PAPER_RATIOS)
    return "\n".join((head, body, paper))


def _cmd_floor(args: argparse.Namespace) -> int:
    from autosp.harness.measure import parse_size

    budget = parse_size(args.device_memory)
    entries = [parse_entry(e) for e in args.methods.split(",")]
    df = floor_table(args.models.split(","), entries, world_size=args.world_size, budget_bytes=budget,
                     dtype=args.dtype, mixed_precision=not args.pure)
    print(format_floor_table(df, world_size=args.world_size, budget_bytes=budget))
    return 0


def add_floor_parser(subparsers: argparse._SubParsersAction) -> None:
    """`autosp floor --models llama-3.1-8b,llama-2-13b --methods autosp:0,autosp:3,zero3,ulysses`."""
    p = subparsers.add_parser("floor", help="analytic per-rank memory floor: longest trainable length per method "
                                            "and ZeRO stage at paper scale")
    p.add_argument("--models", default="llama-3.1-8b,llama-2-13b", help="comma-separated presets")
    p.add_argument("--methods", default="autosp:0,autosp:3,zero3,fsdp,ulysses:0,ulysses:3",
                   help="comma-separated METHOD or METHOD:ZERO_STAGE")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--device-memory", default="80GiB", help="bytes per device, e.g. 80GiB")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype")
    p.add_argument("--pure", action="store_true",
                   help="everything in --dtype (default: mixed precision, fp32 master weights, gradients, moments)")
    p.set_defaults(func=_cmd_floor)
