"""`mark_dynamic` sequence lengths: Dynamo traces once; the backend specialises and stays exact per length."""
from __future__ import annotations

import torch

import autosp
from autosp.compiler.specialize import bind_sizes, is_symbolic
from autosp.compiler.sp.walk import sequence_parallel_pass
from autosp.harness.config import DataConfig
from autosp.harness.launch import launch
from autosp.models import build_model
from autosp.models.data import make_batch
from tests.compiler.graphs import capture, count


def _dynamic_batch(seq_len: int, seed: int = 0):
    batch = make_batch(DataConfig(ignore_fraction=0.3), batch_size=2, seq_len=seq_len, vocab_size=512, seed=seed)
    for t in (batch.input_ids, batch.labels):
        torch._dynamo.mark_dynamic(t, 1)
    return batch


def test_bind_sizes_gives_a_static_graph_the_sp_pass_can_rewrite():
    gm, inputs = capture(build_model("tiny", seed=0), **_dynamic_batch(64).model_kwargs())
    assert is_symbolic(inputs)
    static = bind_sizes(gm, [int(x) if isinstance(x, torch.SymInt) else x for x in inputs])
    assert not any(isinstance(n.meta["example_value"], torch.SymInt) for n in static.graph.nodes if n.users)
    embedding = next(n for n in static.graph.nodes if n.target is torch.nn.functional.embedding)
    assert tuple(embedding.meta["example_value"].shape) == (2, 64, 64)
    assert embedding.meta["example_value"].requires_grad
    rewritten = sequence_parallel_pass(static, sp_rank=1, sp_size=2, group_name="unused")
    assert count(rewritten, torch.ops.autosp_sp.all_to_all.default) == 8


def _three_lengths_one_trace() -> tuple[float, int]:
    model, reference = build_model("tiny", seed=0), build_model("tiny", seed=0)
    compiled = autosp.compile(model, backend="aot_eager", sac="sac", zero=0)
    worst = 0.0
    for seq_len in (64, 32, 128):
        batch = _dynamic_batch(seq_len, seed=seq_len)
        for p in [*model.parameters(), *reference.parameters()]:
            p.grad = None
        loss = compiled(**batch.model_kwargs()).loss
        loss.backward()
        ref = reference(**batch.model_kwargs()).loss
        ref.backward()
        worst = max(worst, abs(loss.item() - ref.item()) / abs(ref.item()))
        for p, q in zip(model.parameters(), reference.parameters()):
            worst = max(worst, float((p.grad - q.grad).norm() / q.grad.norm()))
    return worst, torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_dynamic_lengths_are_exact_without_retracing():
    outcome = launch(_three_lengths_one_trace, world_size=2, timeout_s=300)
    assert outcome.status == "ok", outcome.traceback
    worst, graphs = outcome.results[0]
    assert worst < 1e-5
    assert graphs == 1
