"""Analytic per-layer FLOPs: hand-checked counts, the O(1/S) linear share, and the `autosp flops` command."""
from __future__ import annotations

import argparse

import pytest

from autosp.experiments.flops import add_flops_parser, flops_table, layer_flops, parse_seq_lens
from autosp.harness.config import ConfigError
from autosp.models import get_preset


def test_layer_flops_by_hand_for_tiny() -> None:
    # tiny: d=64, 4 query heads / 2 KV heads of 16, ff=176.
    s = 8
    f = layer_flops("tiny", s, causal=False)
    assert f.q_proj == 2 * s * 64 * 64 and f.o_proj == 2 * s * 64 * 64
    assert f.k_proj == f.v_proj == 2 * s * 64 * 32  # GQA: K/V projections are half as wide
    assert f.gate_proj == f.up_proj == f.down_proj == 2 * s * 64 * 176
    assert f.qk == f.av == 2 * s * s * 16 * 4
    assert f.total == f.attention + f.projections + f.mlp


def test_causal_counts_the_lower_triangle_and_batch_scales_linearly() -> None:
    full, causal = layer_flops("small", 64, causal=False), layer_flops("small", 64)
    assert causal.qk == full.qk * (64 * 65 / 2) / (64 * 64)
    assert causal.linear == full.linear
    assert layer_flops("small", 64, batch=3).total == 3 * causal.total


def test_a_sliding_window_counts_the_keys_each_query_sees() -> None:
    s, window = 64, 10
    windowed, causal = layer_flops("small", s, window=window), layer_flops("small", s)
    pairs = sum(min(q + 1, window) for q in range(s))  # each query: itself and the window - 1 before it
    assert windowed.qk == windowed.av == causal.qk * pairs / (s * (s + 1) / 2)
    assert windowed.linear == causal.linear
    assert layer_flops("small", s, window=s) == layer_flops("small", s, window=2 * s) == causal


def test_linear_share_falls_as_one_over_s() -> None:
    seqs = [1024 * 2**i for i in range(6)]
    df = flops_table(get_preset("llama-3.1-8b"), seqs, causal=False)
    ratio_times_s = df["linear_per_attention"] * df["seq_len"]
    assert ratio_times_s.max() == pytest.approx(ratio_times_s.min())  # exactly c / S without the causal +1
    assert df["linear_share"].is_monotonic_decreasing
    assert df["sac_recompute_overhead"].is_monotonic_decreasing
    causal = flops_table("llama-3.1-8b", seqs)
    assert (causal["attention_fwd_bwd"] == 3 * causal["attention_fwd"]).all()


def test_parse_seq_lens() -> None:
    assert parse_seq_lens(["1K,2k", "8192", "1M"]) == [1024, 2048, 8192, 1024**2]
    for bad in (["1.5K"], ["-4"], ["4G"], [""]):
        with pytest.raises(ConfigError, match="sequence length"):
            parse_seq_lens(bad)


def test_unknown_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown model"):
        flops_table("no-such-model", [1024])


def test_cli_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_flops_parser(parser.add_subparsers())
    args = parser.parse_args(["flops", "--model", "small", "--seq-lens", "1K,4K", "--csv"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("model,seq_len,attention_fwd") and len(lines) == 3
    assert lines[1].startswith("small,1024,") and lines[2].startswith("small,4096,")
