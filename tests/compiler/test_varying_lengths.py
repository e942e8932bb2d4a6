"""Batches of changing length without `mark_dynamic`: Dynamo traces at most twice (the first length static, then
the length symbolic) and each length stays exact against single-process training; past Dynamo's recompile limit
the model never runs unsharded: it stays sharded, or stops with a one-line error naming the limit."""
from __future__ import annotations

import pytest
import torch

import autosp
from autosp.errors import SequenceParallelError
from autosp.harness.config import DataConfig
from autosp.harness.launch import launch
from autosp.models import build_model
from autosp.models.data import make_batch

LENGTHS = (64, 32, 48, 40, 56)


def _batch(seq_len: int) -> dict:
    return make_batch(DataConfig(ignore_fraction=0.3), batch_size=2, seq_len=seq_len, vocab_size=512,
                      seed=seq_len).model_kwargs()


def _five_lengths(name: str) -> dict:
    torch._dynamo.utils.counters.clear()
    model, reference = build_model(name, seed=0), build_model(name, seed=0)
    compiled = autosp.compile(model, backend="aot_eager", zero=0)
    worst, local = 0.0, []
    for seq_len in LENGTHS:
        for p in [*model.parameters(), *reference.parameters()]:
            p.grad = None
        out = compiled(**_batch(seq_len))
        out.loss.backward()
        local.append(out.logits.shape[1])
        ref = reference(**_batch(seq_len)).loss
        ref.backward()
        worst = max(worst, abs(out.loss.item() - ref.item()) / abs(ref.item()))
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            worst = max(worst, float((p.grad - q.grad).norm() / q.grad.norm()))
    return {"worst": worst, "traces": torch._dynamo.utils.counters["stats"]["unique_graphs"], "local": local}


@pytest.mark.parametrize("name", ["tiny", pytest.param("hf:tiny", marks=pytest.mark.long)])
def test_five_lengths_trace_at_most_twice_and_stay_exact(name):
    outcome = launch(_five_lengths, (name,), world_size=2, timeout_s=600)
    assert outcome.status == "ok", outcome.traceback
    result = outcome.results[0]
    assert result["traces"] <= 2, result
    assert result["local"] == [s // 2 for s in LENGTHS]  # every length ran sharded
    assert result["worst"] < 1e-5


def _past_the_limit(static: bool) -> dict:
    torch._dynamo.config.recompile_limit = 2
    compiled = autosp.compile(build_model("tiny", seed=0), backend="aot_eager", zero=0)
    local = []
    for seq_len in range(16, 16 + 2 * 6, 2):  # 6 lengths, three times the limit
        batch = _batch(seq_len)
        if static:
            torch._dynamo.mark_static(batch["input_ids"], 1)
        try:
            local.append(compiled(**batch).logits.shape[1])
        except SequenceParallelError as e:
            return {"local": local, "error": str(e)}
    return {"local": local, "error": None}


@pytest.mark.parametrize("static", [False, True])
def test_past_the_recompile_limit_it_stays_sharded_or_stops_in_one_line(static):
    outcome = launch(_past_the_limit, (static,), world_size=2, timeout_s=600)
    assert outcome.status == "ok", outcome.traceback
    result = outcome.results[0]
    assert all(local < 16 + 2 * 6 for local in result["local"]) and result["local"] == \
        [s // 2 for s in range(16, 16 + 2 * len(result["local"]), 2)]
    if static:  # every length forced static: a compile per length, stopped at the limit
        assert len(result["local"]) == 2 and "recompile_limit=2" in result["error"]
        assert "\n" not in result["error"]
    else:
        assert result["error"] is None and len(result["local"]) == 6
