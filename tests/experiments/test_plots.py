"""Every figure the workflow draws (trainability, throughput, memory, SAC, the simulated paper figure) is readable at
the size it is written: drawn from small synthetic records, no two of its text boxes intersect."""
from __future__ import annotations

import itertools
from unittest import mock

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from matplotlib.text import Text

from autosp.experiments import plots
from autosp.experiments.tables import (
    memory_table,
    sac_table,
    simulated_table_rows,
    throughput_table,
    trainability_table,
)

MiB = 2**20


def overlapping_texts(fig: plt.Figure) -> list[tuple[str, str]]:
    """The pairs of non-empty text boxes that `fig` draws and that intersect (1 px of slack). Only texts drawn
    count: matplotlib keeps tick labels outside the view limits as objects it does not draw."""
    drawn: dict[int, Text] = {}
    draw = Text.draw

    def record(text: Text, renderer: object) -> None:
        draw(text, renderer)
        if text.get_visible() and text.get_text().strip():
            drawn[id(text)] = text

    with mock.patch.object(Text, "draw", record):
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer).padded(-1)) for t in drawn.values()]
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]


def search(method: str, length: int | None, *, model: str = "tiny", zero: int = 3, status: str = "found",
           error: str | None = None, floor: int = 20480) -> dict:
    return {"kind": "search", "method": method, "model": model, "world_size": 2, "device": "cpu",
            "device_name": "cpu", "memory_budget": 48 * MiB, "zero": zero, "status": status, "max_seq_len": length,
            "first_oom_seq_len": None if length is None else length + 512, "floor_limit_seq_len": floor,
            "achieved_over_limit": None, "num_probes": 4, "compile_backend": "inductor", "error": error,
            "timestamp": "2026-12-01T00:00:00"}


def quick_start_table() -> pd.DataFrame:
    """The quick start's cells: five methods on tiny, AutoSP and DeepSpeed's AutoSP on hf:tiny, one failed cell."""
    rows = [search("autosp", 18432), search("ulysses", 4608), search("ring", 4608), search("fsdp", 2560),
            search("zero3", 2560, floor=8192), search("autosp", 16384, model="hf:tiny"),
            search("ds-autosp", 11264, model="hf:tiny", zero=0),
            search("ulysses-compile", None, status="error", error="BackendCompilerFailed: a long reason " * 3)]
    checks = pd.DataFrame([
        {"model": "hf:tiny", "world_size": 2, "method": "autosp", "worst_grad_error": 9.7e-6,
         "gradient_check": "PASSED (worst gradient error 9.7e-06, tolerance 1e-04)"},
        {"model": "hf:tiny", "world_size": 2, "method": "ds-autosp", "worst_grad_error": 7.7e-2,
         "gradient_check": "FAILED (worst gradient error 7.7e-02, tolerance 1e-04)"}])
    return trainability_table(pd.DataFrame(rows), checks=checks)


def throughput() -> pd.DataFrame:
    rows = [{"method": m, "model": "tiny", "world_size": 2, "device": "cpu", "seq_len": s, "status": "ok",
             "iter_time_s.median": t * s / 1024 * (1 + 0.1 * r), "tokens_per_s": s / t, "peak_mem_bytes": 1000,
             "timestamp": "2026-12-01T00:00:00"}
            for m, t in (("ulysses", 1.0), ("autosp", 0.9), ("zero3", 1.3)) for s in (1024, 2048, 4096)
            for r in range(2)]
    return throughput_table(pd.DataFrame(rows))


def memory() -> pd.DataFrame:
    categories = {"attention": 4, "mlp": 6, "norm": 1, "embedding": 1, "other": 2, "unattributed": 0}
    rows = [{"kind": "activations", "method": m, "sac": sac, "model": "small", "seq_len": 2048, "world_size": 2,
             "status": "ok", "error": None, "timestamp": "2026-12-01T00:00:00",
             "extra.saved_activation_bytes": scale * sum(categories.values()) * MiB,
             **{f"extra.saved_by_category.{c}": scale * v * MiB for c, v in categories.items()}}
            for m, sac, scale in (("single", "off", 8.0), ("ulysses", "off", 4.0), ("autosp", "sac", 1.0))]
    return memory_table(pd.DataFrame(rows), baseline="single")


def sac() -> pd.DataFrame:
    rows = [{"kind": "search", "sac": p, "method": "autosp", "model": "tiny", "status": "found", "max_seq_len": n,
             "timestamp": "2026-12-01T00:00:00"} for p, n in (("off", 10240), ("sac", 15360), ("full", 17408))]
    rows += [{"kind": None, "sac": p, "method": "autosp", "model": "tiny", "status": "ok", "seq_len": 2048,
              "iter_time_s.median": t, "timestamp": "2026-12-01T00:00:00"}
             for p, t in (("off", 0.10), ("sac", 0.114), ("full", 0.13))]
    return sac_table(pd.DataFrame(rows))


SIMULATED_MD = ("| model | device | autosp z0 | autosp z3 | ulysses z0 | ulysses z3 | ring z0 | ring z3 | fsdp z3 "
                "| zero3 z3 | ds-autosp (hf) z1 | autosp/ulysses (paper) |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
                + "".join(f"| {model} | {device} | 252K | {168 + k}K | 142K | 46K | 142K | 46K | 6K | 4K | 282K "
                          "| 3.65x (2.7x) |\n"
                          for k, model in enumerate(["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-2-13b"])
                          for device in ("a100-80gb", "gh200-96gb", "mi250-gcd"))
                + "\n36 cells, world size 8, bfloat16.\n")


def simulated(tmp_path) -> pd.DataFrame:
    path = tmp_path / "simulated_table.md"
    path.write_text(SIMULATED_MD.replace("| llama-2-13b | a100-80gb | 252K", "| llama-2-13b | a100-80gb | oom at min"))
    return trainability_table(simulated_table_rows(path))


def all_target_table() -> pd.DataFrame:
    """The `all` target's cells: five methods on three presets, the peer on two HF variants (19 labelled bars)."""
    rows = [search(m, n // scale, model=model) for model, scale in (("tiny", 1), ("small", 2), ("llama3-mini", 2))
            for m, n in (("autosp", 18432), ("ulysses", 4608), ("ring", 4608), ("fsdp", 2560), ("zero3", 1024))]
    rows += [search(m, n, model=model, zero=z) for model in ("hf:tiny", "hf:small")
             for m, n, z in (("autosp", 16384, 3), ("ds-autosp", 11264, 0))]
    return trainability_table(pd.DataFrame(rows))


FIGURES = {
    "trainability": lambda tmp: plots.draw_trainability(quick_start_table()),
    "trainability-all": lambda tmp: plots.draw_trainability(all_target_table()),
    "throughput": lambda tmp: plots.draw_throughput(throughput(), records=None),
    "memory": lambda tmp: plots.draw_memory(memory(), baseline="single"),
    "sac": lambda tmp: plots.draw_sac(sac()),
    "simulated": lambda tmp: plots.draw_trainability(simulated(tmp)),
}


@pytest.mark.parametrize("name", FIGURES)
def test_no_two_labels_of_a_figure_overlap(name, tmp_path) -> None:
    fig = FIGURES[name](tmp_path)
    try:
        assert overlapping_texts(fig) == []
    finally:
        plt.close(fig)


def test_the_overlap_check_fails_on_overlapping_labels() -> None:
    fig, ax = plt.subplots()
    ax.text(0.5, 0.5, "first label")
    ax.text(0.52, 0.5, "second label")
    assert overlapping_texts(fig) == [("first label", "second label")]
    plt.close(fig)


def test_quick_start_ratios_include_the_peer_and_every_baseline_present() -> None:
    ratios = plots.trainability_ratios(quick_start_table()).set_index("baseline")["ratio"]
    assert ratios["ds-autosp"] == pytest.approx(16384 / 11264)  # AutoSP on the same HF model
    assert ratios["ulysses"] == pytest.approx(4.0) and ratios["zero3"] == pytest.approx(18432 / 2560)
    assert "ulysses-compile" not in ratios  # its search failed: no ratio


def test_an_alst_method_gets_its_ratio_when_its_records_exist() -> None:
    table = trainability_table(pd.DataFrame([search("autosp", 8192), search("alst", 4096)]))
    assert plots.trainability_ratios(table).set_index("baseline")["ratio"]["alst"] == pytest.approx(2.0)


def test_simulated_ratios_compare_like_stages(tmp_path) -> None:
    ratios = plots.trainability_ratios(simulated(tmp_path))
    row = ratios[(ratios["model"] == "llama-3.2-1b") & (ratios["device"] == "a100-80gb")].set_index("baseline")
    assert row.loc["ulysses ZeRO-0", "ratio"] == pytest.approx(252 / 142)
    assert row.loc["ulysses ZeRO-3", "ratio"] == pytest.approx(168 / 46)
    assert row.loc["ds-autosp", "ratio"] == pytest.approx(252 / 282)  # stage 1: against AutoSP's longest (z0)
    assert "2.7x NVIDIA" in row.loc["ulysses ZeRO-3", "claim"]


def test_the_floor_is_drawn_only_within_its_factor_of_the_bar() -> None:
    fig = plots.draw_trainability(trainability_table(pd.DataFrame([
        search("autosp", 4096, floor=8192), search("ulysses", 1024, floor=65536)])))
    dashed = [c for ax in fig.axes for c in ax.collections if c.get_linestyle()[0][1] is not None]
    assert len(dashed) == 1  # autosp's floor (2x its bar); ulysses' (64x) says nothing and is left out
    plt.close(fig)


def test_every_method_and_checkpointed_variant_has_a_colour_of_its_own() -> None:
    import matplotlib.colors

    from autosp.experiments.plots import method_color

    methods = ["autosp", "ds-autosp", "alst", "ulysses", "ring", "fsdp", "zero3", "single"]
    methods += [f"{m}[ac=layer]" for m in ("ulysses", "ring", "fsdp", "zero3")]
    colours = [matplotlib.colors.to_rgb(method_color(m)) for m in methods]
    assert len(set(colours)) == len(methods), dict(zip(methods, colours, strict=True))
