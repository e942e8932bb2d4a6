"""`alst`: Arctic Long Sequence Training (arXiv 2506.13996) on HF models, run the way its authors run it.

The recipe of ArcticTraining's SFT trainer (`sequence_parallel_size > 1`, `tiled_mlp_compute`,
`activation_checkpoint_cpu_offload`), on DeepSpeed's own ALST components (`deepspeed.runtime.sequence_parallel.
ulysses_sp`):
- Ulysses SP: `UlyssesSPAttentionHF.register_with_transformers` replaces HF's `sdpa` attention with its all-to-all
  wrapper; HF's mask builder is told to build no mask (causal SDPA over the gathered sequence).
- Inputs: what `UlyssesSPDataLoaderAdapter` does to a batch — labels shifted over the whole sequence
  (`shift_labels`), then every tensor cut into this rank's contiguous sequence chunk (position ids included).
- `TiledMLP` on every decoder MLP, in ceil(S_local / hidden) shards agreed by all ranks (ArcticTraining's patch).
- `TiledFusedLogitsLoss`: logits and loss in shards of ~1 GiB of fp32 logits; each rank's token-weighted loss is
  all-gathered differentiably over the SP group (ArcticTraining's `SFTTrainer.loss`).
- Per-layer activation checkpointing (reentrant) with each layer's checkpointed input in host memory: on CUDA HF's
  own `activation_checkpointing_enable(offload=True)` (torch's `save_on_cpu`, pinned); on CPU the device *is* host
  memory, so the copy goes through autosp's offload op (`autosp.compiler.memory.OFFLOAD_OP`), which the CPU meter
  books as host memory — one host copy per layer either way, the same bytes ALST moves.
- DeepSpeed ZeRO-3, every parameter partitioned, `offload_optimizer: cpu` (fp32 master partitions, fp32 gradient
  partitions and the optimizer's moments in host memory; the step runs on the host): on CUDA with DeepSpeed's CPU
  Adam (ALST's `cpu_adam`); on CPU the same offload path with torch's AdamW as the host optimizer (CPU Adam needs
  a JIT build; `zero_force_ds_cpu_optimizer: false`). The CPU meter counts those host buffers as device memory
  (there they are one memory); the simulator books them as host on a simulated GPU.
ArcticTraining itself is not imported: its 0.8 release requires transformers < 5. What it adds over DeepSpeed is
this glue, restated here; a defect of DeepSpeed's components shows as it is in `autosp check --method alst`.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.strategy import Strategy, TrainStep, register
from autosp.models.build import parameter_count
from autosp.models.llama import IGNORE_INDEX
from baselines.deepspeed_env import DeepSpeedZeroStep, import_deepspeed, precision_config, require_deepspeed
from baselines.recompute_flops import RecomputeCounter
from baselines.zero3 import zero3_config

if TYPE_CHECKING:
    from autosp.harness.parallel import ParallelContext
    from autosp.models.data import Batch

#: ArcticTraining's logits shard: about this many bytes of fp32 logits per TiledFusedLogitsLoss shard
LOGITS_SHARD_BYTES = 2**30


def alst_config(cfg: RunConfig, num_params: int) -> dict[str, Any]:
    """ZeRO-3 as `zero3` tunes it, plus ALST's optimizer offload to host (pinned on GPUs; on CPU a no-op pin)."""
    config = zero3_config(cfg, num_params)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": cfg.device != "cpu"}
    return config


def host_optimizer(model: nn.Module, cfg: RunConfig) -> tuple[torch.optim.Optimizer, str]:
    """ALST's host optimizer and its name for the record: DeepSpeed's CPU Adam on a GPU (ALST's `cpu_adam`), built at
    first use; torch's AdamW on the CPU, and on a GPU where the op cannot build (no compiler, a DeepSpeed wheel made
    with DS_BUILD_OPS=0 on a machine without one): the same two fp32 moments, a slower step."""
    if cfg.device != "cpu":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(model.parameters(), lr=cfg.lr, adamw_mode=True), "deepspeed"
        except Exception as exc:  # noqa: BLE001 - any failure to build or load the op: ALST's step runs on torch's
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            print(f"alst: DeepSpeed's CPU Adam is not available ({reason}); torch's AdamW steps on the host",
                  flush=True)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr), "torch"


def tiled_mlp_forward(mlp: nn.Module, x: torch.Tensor, recompute: RecomputeCounter | None = None) -> torch.Tensor:
    """ArcticTraining's `tiled_mlp_forward_common`: the SwiGLU MLP over ceil(S / hidden) sequence shards, the count
    agreed by every rank (ZeRO-3 gathers must match); `recompute` counts the shards' re-run in backward."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_forward(module: nn.Module, x_shard: torch.Tensor) -> torch.Tensor:
        return module.down_proj(module.act_fn(module.gate_proj(x_shard)) * module.up_proj(x_shard))

    params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
    fn = recompute.wrap(mlp_forward) if recompute is not None else mlp_forward
    return TiledMLP.apply(fn, mlp, x, agreed_mlp_shards(x), params)


def agreed_mlp_shards(x: torch.Tensor) -> int:
    """TiledMLP's shard count: ceil(S_local / hidden), the maximum over the ranks (a read of data: the simulator
    answers it from the shapes, `autosp.experiments.simulate.adapters`)."""
    seqlen, hidden = x.shape[-2:]
    shards = torch.tensor(math.ceil(seqlen / hidden), device=x.device)
    dist.all_reduce(shards, op=dist.ReduceOp.MAX)
    return int(shards.item())


def no_valid_labels(labels: torch.Tensor) -> bool:
    """ArcticTraining's `all(shift_labels == -100)` for one logits tile (a read of data: the simulator answers it
    from the real labels it built the batch from)."""
    return bool((labels == IGNORE_INDEX).all())


def host_booked_checkpoint(function, *args, **kwargs):
    """Reentrant checkpoint whose saved input waits in (emulated) host memory: the CPU twin of HF's offload."""
    from autosp.compiler.memory import OFFLOAD_OP

    def to_host(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        return tensor.device, OFFLOAD_OP(tensor)

    def to_device(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, host = packed
        return host.to(device, copy=True)

    with torch.autograd.graph.saved_tensors_hooks(to_host, to_device):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)


def enable_checkpoint_offload(model: nn.Module, device: torch.device) -> None:
    """Every decoder layer checkpointed, its input in host memory (ArcticTraining:
    `activation_checkpoint_cpu_offload`)."""
    if device.type == "cuda":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True}, offload=True)
        return
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=host_booked_checkpoint)


def counted_checkpoint(checkpoint: Callable, recompute: RecomputeCounter) -> Callable:
    """`checkpoint` whose function, re-run in backward, is counted by `recompute`."""
    def counted(function: Callable, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(recompute.wrap(function), *args, **kwargs)
    return counted


def shard_like_the_adapter(batch: Batch, sp_rank: int, sp_size: int) -> dict[str, torch.Tensor]:
    """`UlyssesSPDataLoaderAdapter.refill` for one sample: labels shifted globally, every tensor cut into this
    rank's chunk of the sequence (position ids made when the data has none, as ALST requires them)."""
    seq_len = batch.input_ids.shape[1]
    position_ids = batch.position_ids
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=batch.input_ids.device).expand_as(batch.input_ids)
    shift_labels = torch.nn.functional.pad(batch.labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    chunk = seq_len // sp_size
    mine = slice(chunk * sp_rank, chunk * (sp_rank + 1))
    return {"input_ids": batch.input_ids[:, mine].contiguous(), "position_ids": position_ids[:, mine].contiguous(),
            "shift_labels": shift_labels[:, mine].contiguous()}


def refuse_a_tied_lm_head(model: nn.Module, name: str) -> None:
    """ALST's recipe fails on a model whose LM head is its embedding (llama-3.2-1b/3b): after
    `TiledFusedLogitsLoss` runs the head's backward inside forward, ZeRO-3's gradient hook meets the shared weight
    without a gradient (DeepSpeed 0.19.8; `tests/baselines/test_alst.py` pins it). Refused in one line at setup."""
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        raise ConfigError(
            f"--method alst cannot train {name}: its LM head is tied to its embedding, and under ZeRO-3 DeepSpeed's "
            "gradient hook finds that weight's gradient None after TiledFusedLogitsLoss's backward inside forward "
            "(AttributeError in stage3 __add_grad_to_ipg_bucket); use a model with an untied head, e.g. "
            "hf:llama-3.1-8b")


class AlstStep(DeepSpeedZeroStep):
    implementation = "alst (deepspeed ulysses_sp + zero3)"

    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig) -> None:
        refuse_a_tied_lm_head(model, cfg.model)
        self.deepspeed = import_deepspeed("alst")
        import transformers.masking_utils
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        self.ctx = ctx
        # at SP degree 1 (one GPU) DeepSpeed registers nothing and returns no mpu: attention stays HF's own
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=ctx.sp_size,
            micro_batch_size=cfg.batch_size, seq_length=cfg.seq_len, seq_length_is_variable=True)
        if ctx.sp_size > 1:  # ArcticTraining: no [B,1,S,S] mask for sdpa under SP (causal SDPA, gathered sequence)
            transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", lambda *args, **kwargs: None)
        # what backward re-runs (every layer's forward, and TiledMLP's shards once more), counted per length
        self.recompute = RecomputeCounter()
        for module in model.modules():
            if type(module).__name__.endswith("MLP") and hasattr(module, "gate_proj"):
                module.forward = MethodType(functools.partial(tiled_mlp_forward, recompute=self.recompute), module)
        enable_checkpoint_offload(model, ctx.device)
        for layer in model.model.layers:  # HF checkpoints each layer through its `_gradient_checkpointing_func`
            layer._gradient_checkpointing_func = counted_checkpoint(layer._gradient_checkpointing_func, self.recompute)
        model.train()
        optimizer, self.host_adam = host_optimizer(model, cfg)
        config = alst_config(cfg, parameter_count(cfg.model))
        if self.host_adam != "deepspeed":
            config["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW as the host optimizer
        self.engine, *_ = self.deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        ctx = self.ctx
        self.recompute.start(tuple(batch.input_ids.shape))
        rows = batch.input_ids.shape[0] // ctx.dp_size
        mine = batch.rows(ctx.dp_rank * rows, (ctx.dp_rank + 1) * rows).to(ctx.device)
        inputs = shard_like_the_adapter(mine, ctx.sp_rank, ctx.sp_size)
        shift_labels = inputs.pop("shift_labels")
        model = self.engine.module
        hidden = model.model(**inputs, use_cache=False).last_hidden_state
        vocab = model.config.vocab_size
        bs, seqlen = shift_labels.shape
        shards = max(1, math.ceil(bs * seqlen * vocab * 4 / LOGITS_SHARD_BYTES))

        def loss_sum(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # SFTTrainer.loss's fn
            logits = module.lm_head(x)
            if no_valid_labels(y):  # cross-entropy would be nan; the gradients are still set (zero)
                return (logits.sum() * 0.0).float()
            good = (y != IGNORE_INDEX).sum()
            return module.loss_function(logits=logits, labels=None, vocab_size=vocab, shift_labels=y) * good

        total = TiledFusedLogitsLoss.apply(loss_sum, model, hidden, shift_labels, None, shards,
                                           [model.lm_head.weight], "sum")
        good = (shift_labels != IGNORE_INDEX).sum()
        loss = total / torch.clamp(good, min=1)
        # differentiable token-weighted mean over the SP ranks (ArcticTraining's SFTTrainer.loss)
        losses = dist_fn.all_gather(loss, group=ctx.sp_group)
        goods = dist_fn.all_gather(good, group=ctx.sp_group)
        loss = sum(part * g for part, g in zip(losses, goods, strict=True)) / sum(goods)
        self.engine.backward(loss)
        logged = loss.detach().clone()
        if ctx.dp_group is not None and ctx.dp_size > 1:  # what a user logs: the mean over data-parallel ranks
            dist.all_reduce(logged, group=ctx.dp_group)
            logged /= ctx.dp_size
        return logged

    @property
    def recompute_flops(self) -> int:
        return self.recompute.flops

    def metrics(self) -> dict[str, Any]:
        """The last step's recomputed FLOPs on this rank (`baselines.recompute_flops`)."""
        return {"recompute_flops": self.recompute.flops, "host_adam": self.host_adam}



@register
class AlstStrategy(Strategy):
    name = "alst"
    description = ("Arctic Long Sequence Training (DeepSpeed's ulysses_sp: Ulysses attention, TiledMLP, tiled "
                   "logits+loss, checkpoint offload; ZeRO-3) on hf:<preset> models, as ArcticTraining runs it")
    sequence_parallel = True
    distributed = False  # one rank is ALST's single-GPU recipe (500K tokens on one H100): no Ulysses, the rest alike
    zero_stages = (3,)

    def validate(self, cfg: RunConfig, num_heads: int, num_kv_heads: int) -> None:
        require_deepspeed(self.name)
        if not cfg.model.startswith("hf:"):
            raise ConfigError(f"--method alst trains HF transformers models (ALST patches HF's attention); "
                              f"use --model hf:{cfg.model}")
        super().validate(cfg, num_heads, num_kv_heads)
        sp = cfg.sp_size or self.default_sp_size(cfg.world_size)
        if num_heads % sp or (num_kv_heads % sp and sp % num_kv_heads):
            raise ConfigError(f"ALST's Ulysses needs the {num_heads} query heads divisible by the SP degree {sp} and "
                              f"the {num_kv_heads} KV heads dividing it or divisible by it; pick another --world-size")
        precision_config(cfg.dtype, self.name)

    def setup(self, model: nn.Module, ctx: ParallelContext, cfg: RunConfig) -> TrainStep:
        return AlstStep(model, ctx, cfg)
