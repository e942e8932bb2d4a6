"""One AutoSP default: `autosp run --method autosp` and `autosp.compile(model)` run the planner (sac, tiling and
offload all decided by it) and make the same plan; the paper's setting is the preset `autosp[paper]`; the harness
converts the compiler's own option errors instead of restating its checks."""
from __future__ import annotations

import argparse

import pytest

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.method_spec import parse_method_spec, spec_label
from autosp.harness.runner import validate

PAPER = {"sac": "sac", "tiling": "off", "offload": "off"}


def test_the_paper_setting_is_a_preset_that_names_its_records():
    assert parse_method_spec("autosp[paper]").options == PAPER
    assert parse_method_spec("autosp[paper,tiling=auto]").options == {**PAPER, "tiling": "auto"}
    with pytest.raises(ConfigError, match=r"autosp has no preset 'fast' \(its presets: paper\)") as info:
        parse_method_spec("autosp[fast]")
    assert "\n" not in str(info.value)
    paper = RunConfig(method="autosp", model="tiny", seq_len=64, **PAPER)
    assert spec_label(paper.to_dict()) == "autosp[paper]"
    assert spec_label(paper.replace(tiling="auto").to_dict()) == "autosp[sac=sac,tiling=auto,offload=off]"
    assert spec_label(RunConfig(method="autosp", model="tiny", seq_len=64).to_dict()) == "autosp"


def test_the_cli_takes_a_spec_as_the_method_and_the_default_is_the_planner():
    from autosp.harness.flags import add_run_config_arguments, run_config_from_args

    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    args = ["--model", "tiny", "--seq-len", "64", "--world-size", "2"]
    default = run_config_from_args(parser.parse_args(["--method", "autosp", *args]))
    assert (default.sac, default.tiling, default.offload) == ("auto", "plan", "auto")
    paper = run_config_from_args(parser.parse_args(["--method", "autosp[paper]", *args]))
    assert paper == default.replace(**PAPER)
    ulysses = run_config_from_args(parser.parse_args(["--method", "ulysses[ac=layer]", *args]))
    assert (ulysses.method, ulysses.ac) == ("ulysses", "layer")


def test_other_methods_record_what_they_recorded_before_the_default_moved():
    """A method that does not read autosp's options records them as before (same `config_hash`, same label)."""
    from autosp.harness.strategy import get_strategy

    cfg = get_strategy("ulysses").own_config(RunConfig(method="ulysses", model="tiny", seq_len=64, world_size=2))
    before = RunConfig(method="ulysses", model="tiny", seq_len=64, world_size=2, **PAPER)
    assert cfg.config_hash() == before.config_hash() and spec_label(cfg.to_dict()) == "ulysses"


@pytest.mark.parametrize("options, text", [
    (dict(offload="activations", compile_backend="eager"), "use backend aot_eager or inductor, not eager"),
    (dict(compile_backend="tvm"), "unknown --compile-backend 'tvm'"),
    (dict(zero=2, offload="optimizer,params"), "params keeps ZeRO-3 shards in host memory.*use zero=3"),
    (dict(offload="weights"), "unknown --offload 'weights'"),
])
def test_the_harness_converts_the_compilers_option_errors(options, text):
    with pytest.raises(ConfigError, match=text) as info:
        validate(RunConfig(method="autosp", model="tiny", seq_len=64, world_size=2, **options))
    assert "\n" not in str(info.value)


def _library_plan(cfg_dict: dict, budget: int) -> tuple[list, list]:
    """One rank: `autosp.compile` with its defaults (the loss only, as the harness's step) at the graph budget the
    harness plans within; the plans and tiles of one step."""
    import autosp
    from autosp.compiler.memory import tiles_of
    from autosp.harness.runner import global_batch
    from autosp.models import build_model

    cfg = RunConfig.from_dict(cfg_dict)
    compiled = autosp.compile(build_model(cfg.model, seed=cfg.seed), sac=f"budget={budget}B",
                              backend=cfg.compile_backend, outputs="loss")
    compiled(**global_batch(cfg, cfg.world_size).model_kwargs()).loss.backward()
    return [r.plan for r in compiled.partition_records], tiles_of(compiled.tiling_reports)


def test_run_and_compile_make_the_same_plan_and_it_fits_where_the_old_defaults_did_not():
    """hf:tiny, P=2, 6,144 tokens in 24 MiB a rank: the default tiles the loss and the MLPs and moves saved values
    to host memory, and fits (17.1 MiB); the library's old default (no tiling: 25.96 MiB) and the paper's setting
    (35.79 MiB) are oom there. `autosp.compile` at the same graph budget makes the same plan and tiles."""
    from autosp.harness.launch import launch
    from autosp.harness.runner import run
    from baselines.autosp_method import sac_policy

    cfg = RunConfig(method="autosp", model="hf:tiny", seq_len=6144, world_size=2, memory_budget=24 << 20, steps=0,
                    compile_backend="aot_eager", timeout_s=600)
    record = run(cfg)
    assert record["status"] == "ok", record["error"]
    (plan,) = record["extra"]["sac_auto"]
    assert plan["fits"] and plan["offloads"] and {t["tile"] for t in record["extra"]["tiles"]} >= {"loss"}
    library = launch(_library_plan, (cfg.to_dict(), sac_policy(cfg, 3).budget_bytes), world_size=2, timeout_s=600)
    assert library.status == "ok", library.traceback
    assert library.results[0] == ([plan], record["extra"]["tiles"])
    old = run(cfg.replace(tiling="off", offload="activations=auto"))
    paper = run(cfg.replace(**PAPER))
    assert old["status"] == paper["status"] == "oom", (old["error"], paper["error"])
    # an oom record keeps the plan that did not fit and what the graphs saved: what one looks at first
    assert old["extra"]["sac_auto"][0]["layers"] == plan["layers"] and paper["extra"]["saved_activation_bytes"] > 0


def test_under_inductor_reloads_stay_where_the_planner_put_them_and_the_plan_fits(tmp_path, monkeypatch):
    """hf:tiny, P=2, ZeRO-3, 4,096 tokens in 18 MiB a rank, Inductor: the planner keeps every value and moves 11.6 MB
    of them to host memory (estimated 10.4 MiB). Inductor's peak-memory reordering issued all of backward's reloads
    before its first matmul (measured 19.15 MiB: oom); with it off (`autosp.compiler.lowering`) they stay among the
    matmuls, a layer ahead of their use, and the step fits (12.83 MiB)."""
    from autosp.harness.runner import run

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the ranks' generated code, read below
    cfg = RunConfig(method="autosp", model="hf:tiny", seq_len=4096, world_size=2, memory_budget=18 << 20, zero=3,
                    steps=0, compile_backend="inductor", timeout_s=600)
    record = run(cfg)
    (plan,) = record["extra"]["sac_auto"]
    assert plan["offloads"] and plan["tokenwise_recompute_layers"] == plan["attention_recompute_layers"] == 0
    assert record["status"] == "ok", record["error"]
    backward = [path.read_text() for path in tmp_path.rglob("*.py") if "autosp_sp.reload.default(" in path.read_text()]
    assert backward
    for code in backward:
        calls = [line for line in code[code.index("def call"):].splitlines()
                 if "autosp_sp.reload.default(" in line or "extern_kernels.mm(" in line]
        first_matmul = next(i for i, line in enumerate(calls) if "extern_kernels.mm(" in line)
        assert any("autosp_sp.reload.default(" in line for line in calls[first_matmul:]), "every reload before backward"


def test_under_inductor_a_tiled_plan_fits_as_planned():
    """tiny, P=2, ZeRO-3, 12,032 tokens in 24 MiB a rank, Inductor: the planner tiles the MLPs (3 tiles a layer),
    recomputes one layer's and moves 22.4 MB of saved values to host memory (estimated 22.07 MiB). Inductor fused a
    gradient summed over the tiles into one kernel, which ran every tile's backward ahead of it, reloads included
    (measured 27.66 MiB on b04afd7: oom); fusing within a tile only (`autosp.compiler.lowering.TileSegments`) it fits
    (23.45 MiB). The cell of docs/measurements/2026-12-06-tile-fusion.md (24,064 tokens in 48 MiB: 53.76 -> 45.21
    MiB) halved, the same plan (docs/measurements/2026-12-06-suite-b.md)."""
    from autosp.harness.runner import run

    cfg = RunConfig(method="autosp", model="tiny", seq_len=12032, world_size=2, memory_budget=24 << 20, zero=3,
                    steps=0, compile_backend="inductor", timeout_s=600)
    record = run(cfg)
    (plan,) = record["extra"]["sac_auto"]
    assert plan["offloads"] and plan["tokenwise_recompute_layers"] == 1 and plan["attention_recompute_layers"] == 0
    assert record["status"] == "ok", record["error"]


def test_on_a_roomy_budget_the_default_tiles_and_moves_nothing():
    from autosp.harness.runner import run

    cfg = RunConfig(method="autosp", model="hf:tiny", seq_len=1024, world_size=2, memory_budget=1 << 30, steps=0,
                    compile_backend="aot_eager", timeout_s=600)
    record = run(cfg)
    assert record["status"] == "ok", record["error"]
    (plan,) = record["extra"]["sac_auto"]
    assert plan["fits"] and not plan["offloads"] and plan["tokenwise_recompute_layers"] == 0
    assert record["extra"]["tiles"] == [] and "optimizer_offload" not in record["extra"]
    assert "-offload:" not in record["implementation"]


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.long)])
def test_the_planners_halved_tiles_match_single_process(world_size):
    """tiny, 1,024 tokens a rank, a budget nothing fits: the planner halves the MLPs' tiles of 512 tokens once, to
    the floor (256), and loss, every gradient and the parameters after AdamW are single-process training's (the
    lever's exactness; tests/compiler/test_tiling_plan.py: where it is chosen)."""
    from autosp.harness.check import check

    cfg = RunConfig(method="autosp", model="tiny", seq_len=1024 * world_size, world_size=world_size, memory_budget=1,
                    tiling="plan:512", compile_backend="aot_eager", timeout_s=600)
    report = check(cfg)
    assert report.passed, report.format()
    assert [plan["mlp_tile_halvings"] for plan in report.plans] == [1]
