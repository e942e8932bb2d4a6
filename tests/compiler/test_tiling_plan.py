"""`tiling="plan"` (the default): a graph is tiled only where the planner finds it does not fit untiled with
everything kept, and then it is lowered once more, tiled, leaving the records of that graph only; single process,
aot_eager, the project's tiny Llama."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition

from autosp.compiler import pipeline
from autosp.compiler.fx import copy_graph
from autosp.compiler.memory import planner
from autosp.compiler.options import CompileOptions
from autosp.compiler.pipeline import Compilation, compile_static
from autosp.models import build_model

IDS = torch.randint(0, 256, (1, 512), generator=torch.Generator().manual_seed(1))


def _step(**options) -> tuple[Compilation, torch.nn.Module]:
    model = build_model("tiny", seed=0)
    compilation = Compilation(CompileOptions(backend="aot_eager", outputs="loss", **options))
    compiled = torch.compile(model, backend=partial(compile_static, compilation), fullgraph=True)
    compiled(input_ids=IDS, labels=IDS).loss.backward()
    return compilation, model


def test_plan_tiles_nothing_where_the_graph_fits_and_tiles_where_it_does_not_exactly():
    roomy, _ = _step()  # no budget on CPU: everything fits
    assert [r.tiled for r in roomy.tiling_reports] == [[]] and len(roomy.partition_fn.records) == 1
    assert roomy.partition_fn.records[0].plan["tokenwise_recompute_layers"] == 0
    tight, model = _step(sac="budget=1MiB")
    (report,) = tight.tiling_reports  # the untiled try left no report, no graph record and no partition record
    assert report.tiled and len(report.mlp) == 2 and len(tight.graphs) == len(tight.partition_fn.records) == 1
    reference = build_model("tiny", seed=0)
    reference(input_ids=IDS, labels=IDS).loss.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    paper, _ = _step(sac="sac", tiling="plan")  # plan is off under any policy but the planner's
    assert [r.tiled for r in paper.tiling_reports] == [[]]


def test_a_reload_does_not_inherit_the_saved_ops_eager_inputs(monkeypatch):
    """Inductor normalises a custom op's arguments against `eager_input_vals` where a node has them: a reload that
    copied an all-to-all's from its saved placeholder failed to lower (P=2, tiling with the planner's offload)."""
    real = pipeline.offload_boundaries

    def planted(fw, bw, num_fwd_outputs, *args):
        for node in bw.graph.find_nodes(op="placeholder"):
            node.meta["eager_input_vals"] = ((), {})  # as a saved custom op's value carries them
        report = real(fw, bw, num_fwd_outputs, *args)
        reloads = [n for n in bw.graph.nodes if n.target is torch.ops.autosp_sp.reload.default]
        assert reloads and not any("eager_input_vals" in n.meta for n in reloads)
        return report

    monkeypatch.setattr(pipeline, "offload_boundaries", planted)
    compilation, _ = _step(sac="sac", offload="activations", tiling="off")
    assert compilation.graphs[0].offload_reports[0].values


LONG_IDS = torch.randint(0, 256, (1, 2048), generator=torch.Generator().manual_seed(2))


def _long_step(**options) -> tuple[Compilation, torch.nn.Module]:
    model = build_model("tiny", seed=0)
    compilation = Compilation(CompileOptions(backend="aot_eager", outputs="loss", **options))
    compiled = torch.compile(model, backend=partial(compile_static, compilation), fullgraph=True)
    compiled(input_ids=LONG_IDS, labels=LONG_IDS).loss.backward()
    return compilation, model


@pytest.fixture(scope="module")
def unhalved() -> dict:
    """The plan of tiny at 2,048 tokens and 1 MiB with the MLPs in tiles of 1,024 and no lever (`auto:1024`)."""
    fixed, _ = _long_step(sac="budget=1MiB", tiling="auto:1024")
    (plan,) = [r.plan for r in fixed.partition_fn.records]
    return plan


def test_where_no_rung_fits_tiled_the_planner_halves_the_blocks_tiles_lowering_its_peak_exactly(unhalved, monkeypatch):
    """tiny, 2,048 tokens, 1 MiB: no rung fits with the MLPs in tiles of 1,024 (tiling="auto:1024", no lever), so
    the default (`plan:1024`) halves them while that lowers the planner's peak: 512 lowers it, 256 does not (the
    tiles no longer bind), so 512 is lowered again and kept; the records are that lowering's only, the plan says
    how many halvings, its peak is below the unhalved one's, and the gradients are single-process training's. Each
    retry (512, 256) partitions only the last rung first (it does not fit), and 512 again its last rung alone (no
    rung fits: the ladder's plan)."""
    assert not unhalved["fits"] and "mlp_tile_halvings" not in unhalved
    partitions = []
    monkeypatch.setattr(planner, "min_cut_rematerialization_partition",
                        lambda *args, **kwargs: partitions.append(1) or min_cut_rematerialization_partition(
                            *args, **kwargs))
    lever, model = _long_step(sac="budget=1MiB", tiling="plan:1024")
    (plan,) = [r.plan for r in lever.partition_fn.records]
    (report,) = lever.tiling_reports
    assert len(lever.graphs) == 1 and [b["tile_tokens"] for b in report.mlp] == [512, 512]
    assert plan["mlp_tile_halvings"] == 1 and plan["estimated_peak_bytes"] < unhalved["estimated_peak_bytes"]
    # tiles of 1,024: the ladder; of 512: the last rung alone (lower); of 256: the last rung alone (not lower, the
    # estimate at 512's or above it); of 512 again: the last rung alone, the plan (it did not fit at 512)
    assert len(partitions) == unhalved["partitions_tried"] + 1 + 1 + 1 and plan["partitions_tried"] == 1
    assert plan["tokenwise_recompute_layers"] == plan["attention_recompute_layers"] == plan["layers"] > 0
    reference = build_model("tiny", seed=0)
    reference(input_ids=LONG_IDS, labels=LONG_IDS).loss.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_the_larger_tiles_lowered_again_get_the_plan_the_ladder_makes(monkeypatch):
    """The lowering after `KeepLargerTiles` partitions its last rung alone (`no_rung_fits`): the same forward and
    backward programs and the same plan as the whole ladder on that joint graph, but for the partitions tried."""
    real, compared = planner.plan_partition, []

    def both(joint_gm, joint_inputs, budget, **kwargs):
        if kwargs.get("no_rung_fits"):
            made = [real(copy_graph(joint_gm), joint_inputs, budget, **{**kwargs, "no_rung_fits": False}),
                    real(joint_gm, joint_inputs, budget, **kwargs)]
            # as made, before the pipeline's later passes and its halvings' count change them
            compared.append([(fw.code, bw.code, dict(plan), offload and offload.nbytes)
                             for fw, bw, plan, offload in made])
            return made[1]
        return real(joint_gm, joint_inputs, budget, **kwargs)

    monkeypatch.setattr(planner, "plan_partition", both)
    _long_step(sac="budget=1MiB", tiling="plan:1024")
    ((ladder, alone),) = compared
    assert ladder[2]["partitions_tried"] > alone[2]["partitions_tried"] == 1 and not alone[2]["fits"]
    assert ladder == (*alone[:2], {**alone[2], "partitions_tried": ladder[2]["partitions_tried"]}, alone[3])


def test_where_a_rung_fits_tiled_the_tiles_stay_as_they_are(unhalved):
    """The budget of the tiled graph's last rung: it fits there, so no halving (the lever is the last resort)."""
    fits, _ = _long_step(sac=f"budget={unhalved['estimated_peak_bytes']}B", tiling="plan:1024")
    (plan,) = [r.plan for r in fits.partition_fn.records]
    assert plan["fits"] and "mlp_tile_halvings" not in plan
    assert [b["tile_tokens"] for r in fits.tiling_reports for b in r.mlp] == [1024, 1024]


def test_a_halving_that_does_not_lower_the_planners_peak_is_not_kept(unhalved, monkeypatch):
    """The planner's estimate made flat (every partition peaks at the same bytes, over the budget): the first
    halving does not lower it, so the tiles of 1,024 are lowered again as they are (no `mlp_tile_halvings`); the
    partitions: the ladder at 1,024, the last rung alone at 512, the last rung alone at 1,024 again (the ladder's
    plan there: no rung fits)."""
    flat = 2 * unhalved["estimated_peak_bytes"]
    real = planner.estimated_peak
    monkeypatch.setattr(planner, "estimated_peak", lambda *args: (flat, real(*args)[1]))
    partitions = []
    monkeypatch.setattr(planner, "min_cut_rematerialization_partition",
                        lambda *args, **kwargs: partitions.append(1) or min_cut_rematerialization_partition(
                            *args, **kwargs))
    kept, model = _long_step(sac="budget=1MiB", tiling="plan:1024")
    (plan,) = [r.plan for r in kept.partition_fn.records]
    assert len(kept.graphs) == 1 and [b["tile_tokens"] for r in kept.tiling_reports for b in r.mlp] == [1024, 1024]
    assert "mlp_tile_halvings" not in plan and not plan["fits"] and plan["estimated_peak_bytes"] == flat
    assert len(partitions) == unhalved["partitions_tried"] + 1 + 1 and plan["partitions_tried"] == 1
    assert plan["tokenwise_recompute_layers"] == plan["attention_recompute_layers"] == plan["layers"] > 0
    reference = build_model("tiny", seed=0)
    reference(input_ids=LONG_IDS, labels=LONG_IDS).loss.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
