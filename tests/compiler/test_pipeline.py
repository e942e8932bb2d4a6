"""The pipeline as data: its passes in order, each with a contract, and `AUTOSP_DUMP_GRAPHS` writing every graph
before and after every pass (single process, aot_eager)."""
from __future__ import annotations

from functools import partial

import torch

from autosp.compiler import pipeline
from autosp.compiler.options import CompileOptions
from autosp.compiler.pipeline import Compilation, compile_static
from autosp.models import build_model


def test_the_passes_in_order_each_with_a_contract() -> None:
    names = [p.name for p in pipeline.GRAPH_PASSES + pipeline.JOINT_PASSES + pipeline.PARTITIONED_PASSES]
    assert names == ["sequence_parallel", "tiling", "gradient_buckets", "gather_prefetch", "offload"]
    assert all(p.requires and p.guarantees and callable(p.run) for p in pipeline.GRAPH_PASSES + pipeline.JOINT_PASSES
               + pipeline.PARTITIONED_PASSES)


def _train_step(tmp_path, monkeypatch, dump: bool) -> list[str]:
    if dump:
        monkeypatch.setenv(pipeline.DUMP_ENV, str(tmp_path / "graphs"))
    else:
        monkeypatch.delenv(pipeline.DUMP_ENV, raising=False)
    torch._dynamo.reset()
    model = build_model("tiny")
    compilation = Compilation(CompileOptions(backend="aot_eager", tiling="loss", outputs="loss", offload="activations"))
    compiled = torch.compile(model, backend=partial(compile_static, compilation), fullgraph=True)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    compiled(input_ids=ids, labels=ids).loss.backward()
    return sorted(p.name for p in (tmp_path / "graphs").glob("*.txt")) if dump else []


def test_dumped_graphs_before_and_after_each_pass(tmp_path, monkeypatch) -> None:
    files = _train_step(tmp_path, monkeypatch, dump=True)
    # (pass, its graph before, after): the joint graph is partitioned into a forward and a backward graph
    steps = [("sequence_parallel", "", ""), ("tiling", "", ""), ("gradient_buckets", "", ""),
             ("partition", "", "-forward"), ("gather_prefetch", "-forward", "-forward"),
             ("offload", "-backward", "-backward")]
    graph = files[0].split("-")[0]
    for index, (name, before, after) in enumerate(steps):
        assert f"{graph}-{index:02d}-{name}-before{before}.txt" in files, (name, files)
        assert f"{graph}-{index:02d}-{name}-after{after}.txt" in files, (name, files)
    assert f"{graph}-05-offload-after-backward.txt" in files
    tiled = (tmp_path / "graphs" / f"{graph}-01-tiling-after.txt").read_text()
    assert "def forward" in tiled and "autosp_sp.linear_cross_entropy" in tiled
    assert "linear_cross_entropy" not in (tmp_path / "graphs" / f"{graph}-01-tiling-before.txt").read_text()
    offloaded = (tmp_path / "graphs" / f"{graph}-05-offload-after-forward.txt").read_text()
    assert "autosp_sp.offload" in offloaded


def test_nothing_is_written_without_the_variable(tmp_path, monkeypatch) -> None:
    _train_step(tmp_path, monkeypatch, dump=False)
    assert not (tmp_path / "graphs").exists()
