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


def model_flops(cfg: RunConfig, dp_size: int) -> float:
    """The step's model FLOPs over the whole job (forward + backward, no recompute: the MFU convention): every
    decoder layer (causal attention) and the LM head, on dp_size x batch sequences of cfg.seq_len tokens."""
    from autosp.models import get_preset

    preset = get_preset(cfg.model)
    batch = dp_size * cfg.batch_size
    layer = layer_flops(preset, cfg.seq_len, batch=batch).total
    head = 2.0 * batch * cfg.seq_len * preset.hidden_size * preset.vocab_size
    return (1 + BACKWARD_FACTOR) * (preset.num_layers * layer + head)


def time_record(time: StepTime, cfg: RunConfig, rates: DeviceRates, dp_size: int) -> dict[str, Any]:
    """`extra.time` of a simulated record: rank 0's step on `rates`' device (every rank runs the same program)."""
    tokens = dp_size * cfg.batch_size * cfg.seq_len
    per_gpu = model_flops(cfg, dp_size) / cfg.world_size
    step = time.iteration_s
    return {
        "prediction": True,
        "time_model": TIME_MODEL,
        "iteration_s": step,
        "tokens_per_s_per_gpu": tokens / step / cfg.world_size if step else None,
        "mfu": per_gpu / step / rates.peak_flops if step else None,
        "exposed_collective_s": time.exposed_collective_s,
        "exposed_copy_s": time.exposed_copy_s,
        "seconds_by_class": time.by_class,
        "executed_flops": time.executed_flops,
        "model_flops_per_gpu": per_gpu,
        "rates": rates.name,
    }
