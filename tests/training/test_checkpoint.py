"""Checkpoints with torch.distributed.checkpoint: save at step 10 on 2 ranks, resume on 4 ranks and on 1, continue
to step 20; the losses and final parameters equal the uninterrupted run's. The export loads with HF's
`from_pretrained` and gives the trained model's logits. Loading refuses a pickle that is not DCP metadata."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

import autosp
from autosp.errors import SequenceParallelError
from autosp.harness.config import DataConfig
from autosp.harness.launch import launch
from autosp.models import build_model
from autosp.models.data import make_batch
from autosp.training import checkpoint

MODEL, STEPS, SAVE_AT, SEQ = "hf:tiny", 20, 10, 48


def _batch(step: int) -> dict:
    return make_batch(DataConfig(), batch_size=1, seq_len=SEQ, vocab_size=512, seed=1000 + step).model_kwargs()


def _train(zero: int, start: int, load_from: str | None, save_to: str | None, export_to: str | None,
           stop: int = STEPS, offload: str = "auto") -> dict:
    """Steps [start, stop) of AdamW on `MODEL` compiled at `zero`; loads `load_from` first, saves at SAVE_AT."""
    model = autosp.compile(build_model(MODEL, seed=0), backend="aot_eager", zero=zero, offload=offload)
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    if load_from:
        assert checkpoint.load(load_from, model, optimizer) == {"step": start}
    losses = {}
    for step in range(start, stop + 1):
        if step == SAVE_AT and save_to:
            checkpoint.save(save_to, model, optimizer, extra={"step": step})
        if step == stop:
            break
        loss = model(**_batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
    if export_to:
        checkpoint.export(export_to, model)
    return {"losses": losses, "params": model.full_parameters(), "zero": model.zero,
            "world": dist.get_world_size()}


def _run(world: int, *args) -> dict:
    outcome = launch(_train, args, world_size=world, timeout_s=600)
    assert outcome.status == "ok", outcome.traceback
    return outcome.results[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    run = _run(2, 3, 0, None, str(root / "step10"), str(root / "export"))
    assert run["zero"] == 3
    return root, run


@pytest.mark.parametrize("world", [4, 1])
def test_resume_at_another_world_size_continues_the_same_training(uninterrupted, world):
    root, reference = uninterrupted
    resumed = _run(world, 3, SAVE_AT, str(root / "step10"), None, None)
    assert resumed["world"] == world and resumed["zero"] == (3 if world > 1 else 0)
    assert sorted(resumed["losses"]) == list(range(SAVE_AT, STEPS))
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(reference["losses"][step], rel=1e-5), step
    for name, value in reference["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.long  # the host optimizer's state is the same tensors as AdamW's plus the master (tests/comm)
def test_the_optimizer_state_in_host_memory_resumes_at_another_world_size(uninterrupted, tmp_path):
    """offload=optimizer: saved on 2 ranks at ZeRO 3 (the fp32 masters among the optimizer state), resumed on 1."""
    _, reference = uninterrupted
    _run(2, 3, 0, None, str(tmp_path / "step10"), None, SAVE_AT, "optimizer")
    resumed = _run(1, 3, SAVE_AT, str(tmp_path / "step10"), None, None, STEPS, "optimizer")
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(reference["losses"][step], rel=1e-5), step
    for name, value in reference["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.long  # the default profile resumes ZeRO 3 at other world sizes (above); this adds stages 1 <-> 2
@pytest.mark.parametrize("saved,resumed", [((1, 2), (2, 4)), ((2, 2), (1, 4))])
def test_resume_at_another_zero_stage(uninterrupted, tmp_path, saved, resumed):
    """ZeRO 1 keeps each parameter's optimizer state on one rank, ZeRO 2 every parameter's shard on each: a
    checkpoint of either resumes at the other (and on 4 ranks), continuing the stage-3 run's training."""
    _, reference = uninterrupted
    (save_zero, save_world), (resume_zero, resume_world) = saved, resumed
    assert _run(save_world, save_zero, 0, None, str(tmp_path / "ckpt"), None, SAVE_AT)["zero"] == save_zero
    run = _run(resume_world, resume_zero, SAVE_AT, str(tmp_path / "ckpt"), None, None)
    assert run["zero"] == resume_zero
    for step, loss in run["losses"].items():
        assert loss == pytest.approx(reference["losses"][step], rel=1e-5), step


def test_export_loads_with_from_pretrained_and_gives_the_trained_logits(uninterrupted):
    transformers = pytest.importorskip("transformers")
    root, reference = uninterrupted
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(root / "export"), attn_implementation="sdpa")
    trained = build_model(MODEL, seed=1)
    trained.load_state_dict(reference["params"])
    ids = _batch(99)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=0, atol=0)
    untrained = build_model(MODEL, seed=0)
    with torch.no_grad():  # the check can fail: the seed's weights give other logits
        assert not torch.allclose(untrained(input_ids=ids).logits, trained(input_ids=ids).logits, atol=1e-3)


class _Boom:
    def __reduce__(self):
        return (print, ("unpickled",))


def test_load_refuses_metadata_that_is_not_dcp_metadata(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(SequenceParallelError, match="builtins.print"):
        checkpoint.load(tmp_path, build_model("tiny", seed=0))
