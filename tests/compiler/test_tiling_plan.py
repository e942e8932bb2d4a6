"""`tiling="plan"` (the default): a graph is tiled only where the planner finds it does not fit untiled with
everything kept, and then it is lowered once more, tiled, leaving the records of that graph only; single process,
aot_eager, the project's tiny Llama."""
from __future__ import annotations

from functools import partial

import torch

from autosp.compiler import pipeline
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
