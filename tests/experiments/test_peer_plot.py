"""`autosp plot peers`: our lengths per GPU setting (searches' answers, lengths that fit as lower bounds) beside the
published peers' lengths as markers."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from autosp.cli import main
from autosp.experiments.peer_plot import draw_peers, peer_lengths
from autosp.harness.config import ConfigError


def record(method, device, world, *, kind=None, status="ok", seq_len=None, max_seq_len=None, model="llama-3.1-8b",
           **extra):
    return dict(method=method, device=device, world_size=world, kind=kind, status=status, seq_len=seq_len,
                max_seq_len=max_seq_len, model=model, **extra)


RECORDS = pd.DataFrame([
    record("autosp", "h100-80gb", 8, kind="search", status="found", max_seq_len=6_000_000),
    record("alst", "h100-80gb", 8, model="hf:llama-3.1-8b", seq_len=524_288),
    record("alst", "h100-80gb", 8, model="hf:llama-3.1-8b", status="oom", seq_len=3_700_000),
    record("alst", "h100-80gb", 8, model="hf:llama-3.1-8b", seq_len=262_144),
    record("autosp", "h100-80gb", 1, kind="search", status="no_oom_up_to_max_len", max_seq_len=1_048_576),
    record("autosp", "h100-80gb", 1, kind="search", status="found", max_seq_len=1024, method_spec="autosp[paper]"),
    record("autosp", "h100-80gb", 1, kind="search", status="found", max_seq_len=9, model="llama-3.2-1b"),
])


def test_each_methods_longest_length_per_setting_and_whether_it_is_a_lower_bound():
    found = peer_lengths(RECORDS, "llama-3.1-8b").set_index(["device", "world_size", "method"])
    assert set(found["mode"]) == {"measured"}  # records without a mode are measured ones
    lengths = found[["length", "bound"]]
    assert lengths.loc[("h100-80gb", 8, "autosp")].tolist() == [6_000_000, False]
    assert lengths.loc[("h100-80gb", 8, "alst")].tolist() == [524_288, True]  # the longest run that fit, not the oom
    assert lengths.loc[("h100-80gb", 1, "autosp")].tolist() == [1_048_576, True]  # the search reached its --max-len
    assert found.loc[("h100-80gb", 1, "autosp[paper]"), "length"] == 1024  # a spec is its own method
    assert len(lengths) == 4  # the other model's search is not drawn


def test_the_figure_draws_the_published_peers_as_markers_and_refuses_a_model_with_nothing(tmp_path):
    fig = draw_peers(RECORDS, "llama-3.1-8b")
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert "alst (published)" in labels and "upipe (published, llama-3-8b)" in labels  # the same shapes
    assert ">=512K" in labels and "5.72M" in labels  # three significant digits
    assert not any("torchtitan" in text for text in labels)  # a throughput anchor, not a longest length
    with pytest.raises(ConfigError, match="no records and no published lengths of llama-3.2-3b"):
        draw_peers(RECORDS, "llama-3.2-3b")
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(dict(r, schema_version=1, run_id=str(i))) + "\n"
                            for i, r in enumerate(RECORDS.to_dict("records"))))
    assert main(["plot", "peers", "--in", str(path), "--out", str(tmp_path / "peers.png")]) == 0
    assert (tmp_path / "peers.png").read_bytes()[:4] == b"\x89PNG"
