"""AutoSPSFTTrainer (TRL's SFTTrainer with AutoSP) on 2 gloo ranks (ZeRO 3, fp32) against the single-process
SFTTrainer on the same seed and data, gradient accumulation 2, clipping that binds: every logged loss, gradient norm,
token accuracy and entropy within 1e-5 relative, the parameters after the last step within 1e-4, `evaluate()`'s
loss within 1e-5; once on padded rows of labels with -100 runs, once packed (`packing=True`: padding-free rows,
position ids restarting per document). What does not compose is refused in one line."""
from __future__ import annotations

import pytest
import torch

from autosp.errors import SequenceParallelError
from autosp.harness.config import DataConfig
from autosp.harness.launch import launch
from autosp.models import build_model
from autosp.models.data import make_batch

pytest.importorskip("accelerate")
trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

STEPS, ACCUMULATE, SEQ, VOCAB = 4, 2, 48, 512
METRICS = ("loss", "grad_norm", "mean_token_accuracy", "entropy")


def _tokenizer():
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                                pad_token="t0", eos_token="t1")


def _rows(count: int) -> list[dict]:
    data = DataConfig(ignore_fraction=0.25)  # uneven label counts: the loss is a mean over the window's labels
    return [{k: v[0].tolist() for k, v in make_batch(data, batch_size=1, seq_len=SEQ, vocab_size=VOCAB, seed=s)
             .model_kwargs().items()} for s in range(count)]


def _documents(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 40, (count,), generator=generator).tolist()
    return [{"input_ids": torch.randint(2, VOCAB, (n,), generator=generator).tolist()} for n in lengths]


class _Logs(transformers.TrainerCallback):
    def __init__(self):
        self.rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.rows.append((state.global_step, *(logs[k] for k in METRICS)))


def _run(output_dir: str, sp: bool, packing: bool) -> dict:
    from datasets import Dataset

    from autosp.training.trl_trainer import AutoSPSFTTrainer

    count = STEPS * ACCUMULATE * 2
    train = Dataset.from_list(_documents(count) if packing else _rows(count))
    evaluation = Dataset.from_list(_documents(6) if packing else _rows(6))
    config = trl.SFTConfig(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2,
                           per_device_eval_batch_size=2, gradient_accumulation_steps=ACCUMULATE, learning_rate=3e-3,
                           max_grad_norm=0.3, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                           use_cpu=True, disable_tqdm=True, bf16=False, gradient_checkpointing=False,
                           packing=packing, max_length=64 if packing else None)
    model, logs = build_model("hf:tiny", seed=0), _Logs()
    common = dict(model=model, args=config, train_dataset=train, eval_dataset=evaluation,
                  processing_class=_tokenizer(), callbacks=[logs])
    if sp:
        trainer = AutoSPSFTTrainer(**common, autosp_options={"zero": 3, "backend": "aot_eager"})
    else:
        trainer = trl.SFTTrainer(**common)
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    params = trainer.sp_model.full_parameters() if sp else {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"logs": logs.rows, "params": params, "eval_loss": eval_loss,
            "zero": getattr(getattr(trainer, "sp_model", None), "zero", None)}


@pytest.mark.parametrize("packing", [False, pytest.param(True, marks=pytest.mark.long)])  # packed: 170 CPU-s
def test_logged_metrics_eval_loss_and_parameters_equal_the_single_process_sft_trainer(tmp_path, packing):
    runs = {}
    for world, sp in ((1, False), (2, True)):
        outcome = launch(_run, (str(tmp_path / f"p{world}"), sp, packing), world_size=world, timeout_s=900)
        assert outcome.status == "ok", outcome.traceback
        runs[world] = outcome.results[0]
    reference, sp = runs[1], runs[2]
    assert sp["zero"] == 3
    assert [r[0] for r in sp["logs"]] == [r[0] for r in reference["logs"]] == list(range(1, STEPS + 1))
    assert any(r[2] > 0.3 for r in reference["logs"])  # clipping binds: the norm must be the global one
    for row, ref in zip(sp["logs"], reference["logs"], strict=True):
        for name, value, expected in zip(METRICS, row[1:], ref[1:], strict=True):
            assert value == pytest.approx(expected, rel=1e-5), (row[0], name)
    assert sp["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    for name, value in reference["params"].items():
        torch.testing.assert_close(sp["params"][name], value, rtol=1e-4, atol=1e-4, msg=name)
    assert not torch.allclose(reference["params"]["model.norm.weight"],
                              build_model("hf:tiny", seed=0).model.norm.weight)


@pytest.mark.parametrize("field,value", [("loss_type", "dft"), ("label_smoothing_factor", 0.1),
                                         ("use_liger_kernel", True), ("activation_offloading", True),
                                         ("compute_loss_func", len)])
def test_what_does_not_compose_is_refused_in_one_line(field, value):
    from autosp.training.trl_trainer import _refuse_what_does_not_compose

    settings = dict(loss_type="nll", label_smoothing_factor=0.0, use_liger_kernel=False, activation_offloading=False)
    args = type("Args", (), settings | {field: value})()
    with pytest.raises(SequenceParallelError, match=field) as info:
        _refuse_what_does_not_compose(args, value if field == "compute_loss_func" else None)
    assert "\n" not in str(info.value)
