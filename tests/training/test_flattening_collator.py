"""Packed documents as users make them: HF's `DataCollatorWithFlattening` (one row, position ids restarting per
document, -100 at each document's first label) through AutoSP on 2 ranks equals single-process training in loss
and every gradient, at a length that does not divide by 2 (the shards' padding)."""
from __future__ import annotations

import pytest
import torch

import autosp
from autosp.harness.launch import launch
from autosp.models import build_model

transformers = pytest.importorskip("transformers")
DOCUMENT_LENGTHS = (17, 5, 30, 9)  # 61 tokens in all


def _features() -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 512, (n,), generator=generator).tolist()} for n in DOCUMENT_LENGTHS]


def _compare() -> dict:
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")(_features())
    model, reference = build_model("hf:tiny", seed=0), build_model("hf:tiny", seed=0)
    loss = autosp.compile(model, backend="aot_eager", zero=0)(**batch).loss
    loss.backward()
    ref = reference(**batch).loss
    ref.backward()
    worst = max(float((p.grad - q.grad).norm() / q.grad.norm())
                for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    # the documents really are separate: one joint causal sequence gives another loss
    joint = build_model("hf:tiny", seed=0)(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    return {"keys": sorted(batch), "loss": loss.item(), "ref": ref.item(), "joint": joint.item(), "worst": worst}


def test_flattened_documents_train_exactly():
    outcome = launch(_compare, world_size=2, timeout_s=900)
    assert outcome.status == "ok", outcome.traceback
    result = outcome.results[0]
    assert "position_ids" in result["keys"] and "attention_mask" not in result["keys"], result["keys"]
    assert result["loss"] == pytest.approx(result["ref"], rel=1e-5)
    assert result["worst"] < 1e-5
    assert abs(result["joint"] - result["ref"]) > 1e-4
