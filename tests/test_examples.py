"""The scripts in examples/ run as users run them (torchrun, 2 gloo ranks, tiny size): train with periodic
checkpoints, resume from the middle one in a fresh directory, and the resumed steps give the uninterrupted run's
losses (the loop's on a model with dropout: its checkpoint restores the RNG state); the exported weights load with
`from_pretrained`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEPS, SAVE_EVERY = 4, 2


#: a model with dropout on the activations (AutoSP refuses attention dropout): a resume must restore the RNG state
DROPOUT_CONFIG = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 512, "n_embd": 64,
                  "n_layer": 2, "n_head": 4, "n_positions": 4096, "attn_pdrop": 0.0, "resid_pdrop": 0.2,
                  "embd_pdrop": 0.2, "use_cache": False}


def _torchrun(script: str, out: Path, config: Path, *extra: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(EXAMPLES / script), "--config", str(config),
               "--data", str(EXAMPLES / "data" / "tiny.jsonl"), "--out", str(out), "--seq-len", "64",
               "--batch-size", "2", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--lr", "3e-3",
               "--backend", "aot_eager", *extra]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _loop_losses(stdout: str) -> dict[int, float]:
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"step"')]
    return {row["step"]: row["loss"] for row in rows}


def _trainer_losses(out: Path) -> dict[int, float]:
    history = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())["log_history"]
    return {row["step"]: row["loss"] for row in history if "loss" in row}


@pytest.mark.parametrize("script,middle,losses,dropout", [
    ("train_autosp.py", f"step-{SAVE_EVERY}", lambda out, stdout: _loop_losses(stdout), True),
    ("train_hf_trainer.py", f"checkpoint-{SAVE_EVERY}", lambda out, stdout: _trainer_losses(out), False),
])
def test_example_trains_resumes_and_exports(tmp_path, script, middle, losses, dropout):
    transformers = pytest.importorskip("transformers")
    config = EXAMPLES / "tiny_config.json"
    if dropout:
        config = tmp_path / "config.json"
        config.write_text(json.dumps(DROPOUT_CONFIG))
    first = tmp_path / "first"
    whole = losses(first, _torchrun(script, first, config))
    assert len(whole) == STEPS and all(v == v for v in whole.values())
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(first / middle, resumed_dir / middle)
    resumed = losses(resumed_dir, _torchrun(script, resumed_dir, config, "--resume"))
    late = [step for step in whole if step >= len(whole) - SAVE_EVERY + min(whole)]
    assert len(late) == SAVE_EVERY
    for step in late:
        assert resumed[step] == pytest.approx(whole[step], rel=1e-5), step
    assert whole[min(whole)] > whole[max(whole)]  # it trains
    model = transformers.AutoModelForCausalLM.from_pretrained(str(first / "final"))
    assert model.config.num_hidden_layers == 2
