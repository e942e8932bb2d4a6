"""`autosp model-state`: measured resident bytes per ZeRO stage beside the floor's prediction."""
from __future__ import annotations

import pandas as pd
import pytest

from autosp.experiments.floor import floor_for
from autosp.experiments.model_state import model_state_table


def _record(zero: int, resident: int, status: str = "ok") -> dict:
    return {"method": "autosp", "model": "small", "world_size": 2, "seq_len": 1024, "zero": zero, "dtype": "float32",
            "status": status, "peak_mem_bytes": 2 * resident, "extra.memory.resident_at_step_start_bytes": resident}


def test_rows_per_stage_with_prediction_ratio_and_shrink_vs_stage0() -> None:
    predicted = {z: (f := floor_for("autosp", "small", world_size=2, zero=z)).params_bytes + f.optimizer_bytes
                 for z in (0, 3)}
    records = pd.DataFrame([_record(0, predicted[0]), _record(3, int(predicted[3] * 1.1)), _record(1, 1, "oom")])
    table = model_state_table(records)
    assert list(table["zero"]) == [0, 3]  # the oom run is not a measurement
    assert table["ratio"].tolist() == pytest.approx([1.0, 1.1], rel=1e-6)
    assert table["vs_stage0"].iloc[1] == pytest.approx(1.1 * predicted[3] / predicted[0], rel=1e-6)
