"""Saved-activation breakdown by operator category, eager (hooks) and compiled (partitioned graphs)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autosp.compiler.memory.saved_report import (
    UNATTRIBUTED,
    category_of_module,
    compiled_breakdown,
    peak_working_set,
    quadratic_saved_values,
    tiles_of,
)
from autosp.experiments.activations import SavedActivationRecorder, breakdown_table, working_set_table
from autosp.compiler.memory.partitioner import sac_backend
from autosp.compiler.memory.planner import estimated_peak
from autosp.compiler.tiling.loss import TilingReport
from autosp.harness.config import ConfigError
from autosp.models import build_model


@pytest.mark.parametrize(
    ("path", "cls", "category"),
    [
        ("model.layers.0.self_attn.q_proj", "Linear", "attention"),
        ("model.layers.0.post_attention_layernorm", "LlamaRMSNorm", "norm"),
        ("model.layers.0.post_attention_layernorm", None, "norm"),
        ("L['args'][0].model.layers.1.mlp.act_fn", "SiLU", "mlp"),
        ("transformer.h.3.ln_1", None, "norm"),
        ("model.layers.0", "LlamaDecoderLayer", "other"),
        ("model.embed_tokens", "Embedding", "other"),
        (None, None, "other"),
    ],
)
def test_category_of_module(path, cls, category) -> None:
    assert category_of_module(path, cls) == category


class _Block(nn.Module):
    """attn saves exp's output, mlp saves the Linear input, norm saves nothing new (same storage as attn's)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _Exp()
        self.mlp = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(x)
        return self.mlp(h * 3.0).sum() + h.sum()


class _Exp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


def test_eager_recorder_books_bytes_by_module_and_skips_parameters() -> None:
    model = _Block()
    with SavedActivationRecorder(model) as rec:
        model(torch.randn(4, 8, requires_grad=True)).backward()
    # exp saves its output (4x8 fp32); the Linear saves its input (h*3, 4x8 fp32), not its weight.
    assert rec.bytes_by_category == {"attention": 128, "mlp": 128, "norm": 0, "other": 0}
    assert not model.attn._forward_pre_hooks  # hooks removed on exit
    with SavedActivationRecorder(model, by_module=False) as rec:
        model(torch.randn(4, 8, requires_grad=True))
    assert rec.bytes_by_category[UNATTRIBUTED] == 256 and rec.total == 256
    # FSDP2 computes with unsharded parameters registered only for the forward (not the model's parameters when
    # the recorder starts): a weight saved for backward is still not an activation
    with SavedActivationRecorder(model) as rec:
        weight = model.mlp.weight
        model.mlp.weight = nn.Parameter(weight.detach().clone())
        model(torch.randn(4, 8, requires_grad=True))
        model.mlp.weight = weight
    assert rec.total == 256


def test_compiled_breakdown_matches_the_record_and_sac_drops_mlp() -> None:
    ids = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(0))
    breakdowns, working = {}, {}
    for policy in ("off", "sac"):
        backend = sac_backend(policy, "aot_eager")
        torch.compile(build_model("tiny"), backend=backend, fullgraph=True)(input_ids=ids, labels=ids).loss.backward()
        breakdowns[policy] = compiled_breakdown(backend.partition_fn.records)
        assert sum(breakdowns[policy].values()) == sum(r.saved_activation_bytes for r in backend.partition_fn.records)
        working[policy] = peak_working_set(backend.partition_fn.records)
        (record,) = backend.partition_fn.records
        table = working_set_table(working[policy])
        assert table.loc["total"].sum() == working[policy]["peak_bytes"] == estimated_peak(
            record.fw_module, record.bw_module, record.num_fwd_outputs)[0]  # every byte at the peak is booked
    assert breakdowns["off"]["mlp"] > 0 and breakdowns["sac"]["mlp"] == 0
    # at the peak (backward) sac holds no saved MLP value and less saved overall than off, which holds MLP values
    assert working["sac"]["at"] == ["backward"] and working["sac"]["saved"]["mlp"] == 0
    assert working["off"]["saved"]["mlp"] > 0 and working["sac"]["working"]["other"] > 0  # the logits' gradient
    assert sum(working["sac"]["saved"].values()) < sum(working["off"]["saved"].values())
    assert 0 < breakdowns["sac"]["attention"] < breakdowns["off"]["attention"]

    table = breakdown_table(breakdowns, baseline="off")
    assert list(table.columns) == ["off", "sac", "sac reduction"]
    assert table.loc["total", "off"] == sum(breakdowns["off"].values())
    assert table.loc["attention", "sac reduction"] == breakdowns["off"]["attention"] / breakdowns["sac"]["attention"]
    assert table.loc["mlp", "sac reduction"] == float("inf")


def test_tiles_name_the_loss_tile_logits_bytes() -> None:
    report = TilingReport(tiled=[{"tokens": 512, "vocab": 1000, "tile_tokens": 128}],
                          mlp=[{"module": "layers.0.mlp", "tokens": 512, "tile_tokens": 256}])
    assert tiles_of([report]) == [
        {"tile": "loss", "tokens": 512, "tile_tokens": 128, "tile_logits_bytes": 128 * 1000 * 4},
        {"tile": "layers.0.mlp", "tokens": 512, "tile_tokens": 256}]


def test_breakdown_table_needs_a_known_baseline() -> None:
    with pytest.raises(ConfigError, match="baseline"):
        breakdown_table({"a": {"attention": 1}}, baseline="b")


@pytest.mark.parametrize(("model", "quadratic"), [("hf:tiny", True), ("tiny", False)])
def test_saved_values_quadratic_in_the_sequence_are_named(model, quadratic) -> None:
    """Without the SP pass HF Llama's dense [B, 1, S, S] mask is saved for SDPA's backward; the project Llama
    (is_causal) saves nothing quadratic."""
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(0))
    backend = sac_backend("off", "aot_eager")
    torch.compile(build_model(model), backend=backend, fullgraph=True)(input_ids=ids, labels=ids).loss.backward()
    found = quadratic_saved_values(backend.partition_fn.records, 48)
    assert bool(found) == quadratic
    assert all("(1, 1, 48, 48)" in name and size >= 48 * 48 for name, size in found.items())
