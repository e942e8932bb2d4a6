"""AutoSPTrainer on 2 gloo ranks (ZeRO 3, fp32) against the single-process HF Trainer on the same seed and data:
20 optimizer steps, gradient accumulation 2, clipping that binds, a linear schedule with warm-up. Every logged loss
and gradient norm within 1e-5 relative, the parameters after step 20 within 1e-4, `evaluate()`'s loss within 1e-5;
what does not compose is refused."""
from __future__ import annotations

import pytest
import torch

from autosp.errors import SequenceParallelError
from autosp.harness.config import DataConfig
from autosp.harness.launch import launch
from autosp.models import build_model
from autosp.models.data import make_batch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

STEPS, ACCUMULATE, SEQ = 20, 2, 48


def _dataset() -> list[dict]:
    data = DataConfig(ignore_fraction=0.25)  # uneven label counts: the loss is a mean over the window's labels
    return [{k: v[0] for k, v in make_batch(data, batch_size=1, seq_len=SEQ, vocab_size=512, seed=s)
             .model_kwargs().items()} for s in range(STEPS * ACCUMULATE * 2)]


def _args(output_dir: str, **overrides):
    settings = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2,
                    gradient_accumulation_steps=ACCUMULATE, learning_rate=3e-3, weight_decay=0.1, warmup_steps=3,
                    lr_scheduler_type="linear", max_grad_norm=0.3, logging_steps=1, save_strategy="no",
                    report_to=[], seed=0, use_cpu=True, disable_tqdm=True)
    return transformers.TrainingArguments(**(settings | overrides))


class _Logs(transformers.TrainerCallback):
    def __init__(self):
        self.rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.rows.append((state.global_step, logs["loss"], logs["grad_norm"]))


def _train(output_dir: str, sp: bool) -> dict:
    from autosp.training.hf_trainer import AutoSPTrainer

    model, logs = build_model("hf:tiny", seed=0), _Logs()
    common = dict(model=model, args=_args(output_dir), train_dataset=_dataset(), eval_dataset=_dataset()[:5],
                  callbacks=[logs])
    if sp:
        trainer = AutoSPTrainer(**common, autosp_options={"zero": 3, "backend": "aot_eager"})
    else:
        trainer = transformers.Trainer(**common)
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    params = trainer.sp_model.full_parameters() if sp else {k: v.detach().clone() for k, v in model.named_parameters()}
    zero = getattr(getattr(trainer, "sp_model", None), "zero", None)
    return {"logs": logs.rows, "params": params, "eval_loss": eval_loss, "zero": zero}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for world, sp in ((1, False), (2, True)):
        outcome = launch(_train, (str(tmp_path_factory.mktemp(f"p{world}")), sp), world_size=world, timeout_s=900)
        assert outcome.status == "ok", outcome.traceback
        out[world] = outcome.results[0]
    return out


def test_every_logged_loss_and_norm_equal_the_single_process_trainer(runs):
    reference, sp = runs[1]["logs"], runs[2]["logs"]
    assert runs[2]["zero"] == 3
    assert [r[0] for r in sp] == [r[0] for r in reference] == list(range(1, STEPS + 1))
    assert any(r[2] > 0.3 for r in reference)  # clipping binds: the norm must be the global one
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(sp, reference, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5), step
        assert norm == pytest.approx(ref_norm, rel=1e-5), step


def test_evaluate_gives_the_single_process_eval_loss(runs):
    assert runs[2]["eval_loss"] == pytest.approx(runs[1]["eval_loss"], rel=1e-5)


def test_parameters_after_the_last_step_equal_the_single_process_trainer(runs):
    reference = runs[1]["params"]
    assert runs[2]["params"].keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(runs[2]["params"][name], value, rtol=1e-4, atol=1e-4, msg=name)
    assert not torch.allclose(reference["model.norm.weight"], build_model("hf:tiny", seed=0).model.norm.weight)


@pytest.mark.parametrize("field,value", [("fp16", True), ("torch_compile", True), ("gradient_checkpointing", True),
                                         ("deepspeed", "ds.json")])
def test_what_does_not_compose_is_refused_in_one_line(field, value):
    from autosp.training.hf_trainer import _refuse_what_does_not_compose

    with pytest.raises(SequenceParallelError, match=field) as info:
        _refuse_what_does_not_compose(type("Args", (), {field: value})())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("setting,keywords", [("compute_metrics", {"compute_metrics": len}),
                                              ("sp_size", {"autosp_options": {"sp_size": 1}}),
                                              ("offload=optimizer", {"autosp_options": {"offload": "optimizer"}})])
def test_what_the_trainer_cannot_shard_is_refused_in_one_line(tmp_path, setting, keywords):
    from autosp.training.hf_trainer import AutoSPTrainer

    with pytest.raises(SequenceParallelError, match=setting) as info:
        AutoSPTrainer(model=build_model("hf:tiny", seed=0), args=_args(str(tmp_path)), train_dataset=_dataset(),
                      **keywords)
    assert "\n" not in str(info.value)


def test_predict_is_refused_in_one_line():
    from autosp.training.hf_trainer import AutoSPMixin

    with pytest.raises(SequenceParallelError, match="predict") as info:
        AutoSPMixin.predict(None, _dataset())
    assert "\n" not in str(info.value)
