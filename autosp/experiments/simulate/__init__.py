"""`autosp simulate`: one rank's peak memory of a P-rank job on a GPU you do not have, predicted on this CPU.

Rank r's real program runs on fake tensors: a fake process group makes this process rank r of P without peers,
`FakeTensorMode` makes every tensor shape-only, and the harness builds the model, hands it to the method's
`Strategy.setup` and runs a warm-up and one measured step while `LiveStorageTracker` counts each storage an
executed aten op makes from its creation until Python frees it, at the device's allocator blocks. Compiled
methods run their real graphs through aot_eager (inductor's fusion is not modelled, stated in the record);
DeepSpeed's engines run as they are with the adapters of `adapters`. Deep models are simulated at 2 and 3 (or 3
and 4) layers and extrapolated phase by phase (`extrapolate`); a search shares each depth's program across its
probes (`programs.shared_rank_programs`). What it cannot run it says in one line, never a number. The reasoning
and the runs behind each choice: docs/measurements/2026-12-01-design-simulator.md.

Modules: `config` (what is executed), `tracker` (the storage tracker and peaks), `world` (the fake process group),
`adapters` (DeepSpeed and device adapters), `programs` (rank programs and their cache), `extrapolate` (depth),
`lengths` (records and the length search), `cli` (`autosp simulate`), `clock` (each op of the measured step recorded
for the time model) and `speed` (the record's predicted step, `extra.time`). The names below are the package's API.
"""
from __future__ import annotations

from autosp.experiments.simulate import extrapolate, programs
from autosp.experiments.simulate.adapters import optimizer_implementation_of
from autosp.experiments.simulate.cli import VALIDATION_KEY, add_simulate_parser, validation_table
from autosp.experiments.simulate.config import (
    AFTER_BACKWARD,
    COMPONENTS,
    DIRECT_INDUCTOR_BACKEND,
    EXACT_LAYERS,
    SIMULATED_BACKEND,
    UNSUPPORTED,
    SimulationError,
    simulate_config,
)
from autosp.experiments.simulate.extrapolate import (
    LAST_RUNG_SAC,
    NOT_LINEAR_IN_DEPTH,
    SECOND_PAIR,
    extrapolate_peak,
    predict_peak,
)
from autosp.experiments.simulate.lengths import curve_hint, simulate, simulated_search, summary_line
from autosp.experiments.simulate.programs import (
    SHARED_PROGRAM_METHODS,
    RankProgram,
    rank_peak,
    shared_rank_programs,
    simulate_rank,
)
from autosp.experiments.simulate.tracker import LINEAR_TERMS, LiveStorageTracker, PeakMoment, PhasePeak, RankPeak
from autosp.experiments.simulate.world import fake_world

__all__ = ["AFTER_BACKWARD", "COMPONENTS", "DIRECT_INDUCTOR_BACKEND", "EXACT_LAYERS", "LAST_RUNG_SAC", "LINEAR_TERMS",
           "NOT_LINEAR_IN_DEPTH", "SECOND_PAIR", "SHARED_PROGRAM_METHODS", "SIMULATED_BACKEND", "UNSUPPORTED",
           "VALIDATION_KEY", "LiveStorageTracker", "PeakMoment", "PhasePeak", "RankPeak", "RankProgram",
           "SimulationError", "add_simulate_parser", "curve_hint", "extrapolate", "extrapolate_peak", "fake_world",
           "optimizer_implementation_of", "predict_peak", "programs", "rank_peak", "shared_rank_programs", "simulate",
           "simulate_config", "simulate_rank", "simulated_search", "summary_line", "validation_table"]
