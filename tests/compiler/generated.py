"""Generated SP-pass cases (`test_properties`): a model spec, a batch spec and compile options as one plain dict,
built and checked inside the ranks. Each case runs one forward/backward through `autosp.compile` on P gloo ranks
and through the single-process model; its outcome is the worst relative error of the loss and of every gradient,
a refusal (`SequenceParallelError`, kept as its message) or any other exception (type, message, traceback tail).
All cases of one world size share one launch: starting P ranks and importing torch costs more than a case."""
from __future__ import annotations

import copy
import importlib
import json
import os
import shutil
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import autosp
from autosp.errors import SequenceParallelError
from autosp.harness.check import relative_error
from autosp.harness.launch import launch
from autosp.models.build import init_parameters
from autosp.models.data import DataConfig, make_batch
from autosp.models.llama import LlamaForCausalLM
from autosp.models.presets import ModelPreset

VOCAB = 64

#: HF rope_parameters per rope variant (the project Llama has the default rope only, at either theta)
ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "theta-500k": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0},
}


def build(model: dict[str, Any]) -> torch.nn.Module:
    """The spec's model with `init_parameters`' seeded weights: family llama (the project's) or hf-llama,
    hf-qwen2, hf-mistral (HF's own code, sdpa attention; `window` a sliding window for Qwen2/Mistral)."""
    heads, kv, head_dim, layers = model["heads"], model["kv_heads"], model["head_dim"], model["layers"]
    hidden = model["hidden"] if model["family"] != "llama" else heads * head_dim
    if model["family"] == "llama":
        preset = ModelPreset("generated", hidden, layers, heads, kv, 2 * hidden, VOCAB,
                             ROPE[model["rope"]]["rope_theta"], model["tied"], 4096)
        net = LlamaForCausalLM(preset)
    else:
        import transformers

        family = model["family"].removeprefix("hf-")
        window: dict = {}
        if family == "mistral":
            window = {"sliding_window": model["window"]}
        elif family == "qwen2":
            window = {"use_sliding_window": model["window"] is not None, "sliding_window": model["window"],
                      "max_window_layers": layers // 2}
        name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[family]
        config = getattr(transformers, f"{name}Config")(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=4096,
            rope_parameters=dict(ROPE[model["rope"]]), tie_word_embeddings=model["tied"], use_cache=False, **window)
        net = getattr(transformers, f"{name}ForCausalLM")._from_config(config, attn_implementation="sdpa")
    init_parameters(net, seed=0)
    return net.train()


def _outcome(case: dict[str, Any]) -> dict[str, Any]:
    model = build(case["model"])
    reference = copy.deepcopy(model)
    data = case["data"]
    batch = make_batch(DataConfig(ignore_fraction=data["ignore_fraction"], packed_documents=data["documents"],
                                  pad_fraction=data["pad_fraction"], pad_side=data["pad_side"]),
                       batch_size=data["batch_size"], seq_len=data["seq_len"], vocab_size=VOCAB, seed=7).model_kwargs()
    try:
        compiled = autosp.compile(model, backend="aot_eager", **case["options"])
        loss = compiled(**batch).loss
        loss.backward()
        grads = compiled.full_gradients()
    except SequenceParallelError as e:
        return {"refused": str(e)}
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    # a batch without one supervised token (every label ignored or padding) has a nan loss in one process too:
    # AutoSP agrees when it gives nan as well
    both_nan = bool(loss.detach().isnan() and ref_loss.detach().isnan())
    worst = {"loss": 0.0 if both_nan else relative_error(loss.detach(), ref_loss.detach()), "grad": 0.0,
             "worst_grad": None}
    ref_grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in reference.named_parameters()}
    floor = GRAD_FLOOR * float(torch.cat([g.double().flatten() for g in ref_grads.values()]).norm())
    for name, ref_grad in ref_grads.items():
        error = _grad_error(grads[name], ref_grad, floor) if name in grads else float("inf")
        if error > worst["grad"] or worst["worst_grad"] is None:
            worst["grad"], worst["worst_grad"] = max(error, worst["grad"]), name
    return worst


def _plant(plant: str | None) -> None:
    """Call `plant`, "module:function" (default function `plant`), which patches the pass in this rank to plant a bug
    (`tests.compiler.planted`)."""
    if plant is not None:
        module, _, function = plant.partition(":")
        getattr(importlib.import_module(module), function or "plant")()


#: a parameter's gradient is compared relative to its own norm, or to GRAD_FLOOR x the whole gradient's norm where
#: its own is smaller: there the reference is fp32 rounding noise (a case with one label per document gave q_proj a
#: reference gradient of norm 1.6e-9 against 2.4 for v_proj, AutoSP exactly 0: relative error 1.0, absolute 7e-10
#: of the whole gradient)
GRAD_FLOOR = 1e-4


def _grad_error(value: torch.Tensor, reference: torch.Tensor, floor: float) -> float:
    if value.shape != reference.shape:
        return float("inf")
    diff = float((value.double() - reference.double()).norm())
    scale = max(float(reference.double().norm()), floor)
    return diff / scale if scale else (0.0 if diff == 0.0 else float("inf"))


def _rank_cases(cases: list[dict[str, Any]], plant: str | None = None) -> list[dict[str, Any]]:
    """Every case in this rank, in order; one case's exception is its outcome and the others still run."""
    _plant(plant)
    outcomes = []
    for case in cases:
        torch._dynamo.reset()  # each case compiles afresh, as in a process of its own
        try:
            outcomes.append(_outcome(case))
        except Exception as e:  # noqa: BLE001 - the case's outcome (the property says it must not happen)
            outcomes.append({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
    return outcomes


def run_cases(cases: list[dict[str, Any]], plant: str | None = None) -> list[dict[str, Any]]:
    """Each case's outcome on rank 0, one launch per world size (`case["world_size"]`), in the cases' order.
    A launch that fails as a whole (a crash, a hang past its timeout) is every one of its cases' outcome."""
    outcomes: list[dict[str, Any] | None] = [None] * len(cases)
    for world_size in sorted({c["world_size"] for c in cases}):
        index = [i for i, c in enumerate(cases) if c["world_size"] == world_size]
        result = launch(_rank_cases, ([cases[i] for i in index], plant), world_size=world_size,
                        timeout_s=300 + 120 * len(index))
        for k, i in enumerate(index):
            if result.status != "ok":
                outcomes[i] = {"error": f"launch {result.status}: {result.error}", "traceback": result.output_tail}
            else:  # rank 0's outcome, unless another rank raised
                outcomes[i] = next((r[k] for r in result.results if "error" in r[k]), result.results[0][k])
    return outcomes


def _serve(inbox: str, plant: str | None) -> None:
    """Body of a `CaseServer` rank: run inbox/case-<i>.json for i = 0, 1, ... as each appears, writing this
    rank's outcome to inbox/outcome-<i>.<rank>.json, until inbox/stop appears."""
    import torch.distributed as dist

    _plant(plant)
    rank, folder = dist.get_rank(), Path(inbox)
    for i in range(1 << 30):
        request = folder / f"case-{i}.json"
        while not request.exists():
            if (folder / "stop").exists():
                return
            time.sleep(0.05)
        _publish(folder / f"outcome-{i}.{rank}.json", _rank_cases([json.loads(request.read_text())])[0])


def _publish(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class CaseServer:
    """P ranks that stay up across cases: one launch serves every case a search asks for one at a time (Hypothesis
    shrinking a failure asks for cases one by one; a launch per case would cost a rank start each).
    A case that does not finish within `case_timeout_s` is an `error` outcome and ends the server."""

    def __init__(self, world_size: int, plant: str | None = None, case_timeout_s: float = 300.0) -> None:
        self.world_size, self.case_timeout_s, self.cases = world_size, case_timeout_s, 0
        self.inbox = Path(tempfile.mkdtemp(prefix="autosp-cases-"))
        self.result: list[Any] = []
        self.thread = threading.Thread(target=lambda: self.result.append(
            launch(_serve, (str(self.inbox), plant), world_size=world_size, timeout_s=24 * 3600)), daemon=True)
        self.thread.start()

    def run(self, case: dict[str, Any]) -> dict[str, Any]:
        """`case`'s outcome (rank 0's, unless another rank raised)."""
        i, self.cases = self.cases, self.cases + 1
        _publish(self.inbox / f"case-{i}.json", case)
        paths = [self.inbox / f"outcome-{i}.{r}.json" for r in range(self.world_size)]
        deadline = time.monotonic() + self.case_timeout_s
        while not all(p.exists() for p in paths):
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.close()
                ended = self.result[0] if self.result else None
                why = f"{ended.status}: {ended.error}" if ended else f"no outcome within {self.case_timeout_s:.0f} s"
                return {"error": f"case server {why}", "traceback": getattr(ended, "output_tail", "")}
            time.sleep(0.05)
        outcomes = [json.loads(p.read_text()) for p in paths]
        return next((o for o in outcomes if "error" in o), outcomes[0])

    def close(self) -> None:
        (self.inbox / "stop").touch()
        self.thread.join(timeout=120)
        shutil.rmtree(self.inbox, ignore_errors=True)
