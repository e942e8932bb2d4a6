"""A simulated step's predicted time as the record carries it (`extra.time`): the step, tokens/s per GPU, MFU and
the seconds of collectives and copies the compute stream waited for. Predictions, labelled so in the record."""
from __future__ import annotations

from typing import Any

from autosp.experiments.flops import BACKWARD_FACTOR, layer_flops
from autosp.harness.config import RunConfig
from autosp.timing import DeviceRates, StepTime

#: the time model's version, in every record's `extra.time.time_model` (a record without one: version 1)
TIME_MODEL = 2
#: what each earlier version of the time model left out, for the tables that still show its predictions
EARLIER_TIME_MODELS = {
    1: "priced a compiled plan's recomputed attention (inside the partitioner's RNG wrappers) as a memory op, so "
       "its step is low by up to 1.8x where autosp recomputes attention (fixed in 69cbb22: "
       "docs/measurements/2026-12-06-recomputed-attention-time.md)",
}


#: the model families whose layers `model_flops` counts: Llama's (its own and HF's), with a sliding window in every
#: layer (Mistral) or the upper half (Qwen2), with experts in place of the MLP (Mixtral)
COUNTED_FAMILIES = ("llama", "mistral", "qwen2", "mixtral")


def model_flops(cfg: RunConfig, dp_size: int) -> float | None:
    """The step's model FLOPs over the whole job (forward + backward, no recompute: the MFU convention): every
    decoder layer (causal attention, within the model's window) and the LM head, on dp_size x batch sequences of
    cfg.seq_len tokens. None for a family outside `COUNTED_FAMILIES` (latent or sparse attention, linear-attention
    layers): Llama's count would misstate it."""
    from autosp.models import get_preset
    from autosp.models.hf import MOE_EXPERTS, MOE_TOP_K
    from autosp.models.presets import HFVariant, hf_variant, is_hf_name

    preset = get_preset(cfg.model)
    variant = hf_variant(cfg.model) if is_hf_name(cfg.model) else HFVariant("llama", None)
    if variant.family not in COUNTED_FAMILIES:
        return None
    batch = dp_size * cfg.batch_size
    tokens = batch * cfg.seq_len
    layers = 0.0
    for index in range(preset.num_layers):
        windowed = variant.family == "mistral" or (variant.family == "qwen2" and index >= preset.num_layers // 2)
        f = layer_flops(preset, cfg.seq_len, batch=batch, window=variant.sliding_window if windowed else None)
        mlp = f.mlp * MOE_TOP_K + 2.0 * tokens * preset.hidden_size * MOE_EXPERTS if variant.family == "mixtral" \
            else f.mlp  # each token through its top-k experts, and the router
        layers += f.attention + f.projections + mlp
    head = 2.0 * tokens * preset.hidden_size * preset.vocab_size
    return (1 + BACKWARD_FACTOR) * (layers + head)


def time_record(time: StepTime, cfg: RunConfig, rates: DeviceRates, dp_size: int) -> dict[str, Any]:
    """`extra.time` of a simulated record: rank 0's step on `rates`' device (every rank runs the same program)."""
    tokens = dp_size * cfg.batch_size * cfg.seq_len
    job = model_flops(cfg, dp_size)
    per_gpu = None if job is None else job / cfg.world_size
    step = time.iteration_s
    return {
        "prediction": True,
        "time_model": TIME_MODEL,
        "iteration_s": step,
        "tokens_per_s_per_gpu": tokens / step / cfg.world_size if step else None,
        "mfu": per_gpu / step / rates.peak_flops if step and per_gpu is not None else None,
        "exposed_collective_s": time.exposed_collective_s,
        "exposed_copy_s": time.exposed_copy_s,
        "seconds_by_class": time.by_class,
        "executed_flops": time.executed_flops,
        "model_flops_per_gpu": per_gpu,
        "rates": rates.name,
    }
