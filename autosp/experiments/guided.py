"""The simulator as the trainability search's guide (`autosp search --guide simulate`, the default).

`simulated` predicts a search's answer with `autosp simulate --search` for the same run configuration on the
device it is measured on, in the search's own process (rank 0's real program on fake tensors: no ranks, no
training, no inductor compile), so the measured search (`autosp.experiments.search.guided_search_max_length`)
needs only two probes, the predicted maximum and one step above it, where the simulator is right, and falls back
to bracketing where it is not. On the CPU device the simulator counts what the CPU meter measures (live tensor
bytes, no allocator rounding); on a GPU the device type is looked up in the simulator's catalogue by the GPU's
name. What it cannot predict (a device type missing from the catalogue, a method it cannot run) is a ConfigError:
the search then runs unguided and its row says why.
"""
from __future__ import annotations

import re

from autosp.harness.config import ConfigError, RunConfig


def simulated(cfg: RunConfig, *, granularity: int, min_len: int, max_len: int) -> int:
    """The simulated search's answer for `cfg` (0: not even `min_len` trains); a search `Predictor`."""
    from autosp.experiments import simulate
    from autosp.experiments.search import FOUND, NO_OOM_UP_TO_MAX, OOM_AT_MIN

    device = device_model(cfg)
    try:
        row = simulate.simulated_search(cfg, device, granularity=granularity, min_len=min_len, max_len=max_len)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a simulator failure costs the guidance, never the measured search
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"the simulator failed: {type(exc).__name__}: {first}") from exc
    if row["status"] == OOM_AT_MIN:
        return 0
    if row["status"] in (FOUND, NO_OOM_UP_TO_MAX):
        return row["max_seq_len"]
    raise ConfigError(f"the simulator could not run it: {row.get('error')}")


simulated.guide_name = "simulate"  # the search row's `guide` entry


def device_model(cfg: RunConfig):  # noqa: ANN201 - a DeviceModel
    """The simulator's model of the device `cfg` is measured on: the CPU meter's, or the catalogue's GPU."""
    from autosp.experiments.simulate.devices import device_catalogue, get_device_model

    if cfg.device == "cpu":
        return get_device_model("cpu", cfg.memory_budget)
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("no GPU here to look up in the simulator's catalogue")
    gpu = torch.cuda.get_device_properties(0)
    name = gpu.name.lower()
    matches = [d for d in device_catalogue().values()
               if d.vendor != "cpu" and re.search(rf"\b{re.escape(d.name.split('-')[0])}\b", name)]
    if not matches:
        raise ConfigError(f"the GPU {gpu.name!r} is not in the simulator's catalogue (autosp/reference/device_memory.csv)")
    best = min(matches, key=lambda d: abs(d.memory_bytes - gpu.total_memory))
    return get_device_model(best.name, cfg.memory_budget)
