"""The time model of one training step: device rates (`rates`, the catalogue `autosp/reference/device_rates.csv`)
and the streams a step's ops run on (`timeline`). Pure: no harness, no simulator, so the compiler's memory planner
can price its choices with it (`autosp/compiler/memory/`) and the simulator can time a rank program with it
(`autosp/experiments/simulate/clock.py`). Every figure it gives is a prediction."""
from __future__ import annotations

from autosp.timing.rates import DeviceRates, collective_bytes, device_rates, rates_catalogue
from autosp.timing.timeline import StepTime, Timeline

__all__ = ["DeviceRates", "StepTime", "Timeline", "collective_bytes", "device_rates", "rates_catalogue"]
