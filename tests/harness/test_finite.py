"""A non-finite gradient is an `error` in the step that makes it, naming the first such parameter (every rank
agrees), for methods whose gradients live in `.grad`, in AutoSP's ZeRO-3 shards and in DeepSpeed's partitions."""
import pytest
import torch

from autosp.harness.config import RunConfig
from autosp.harness.runner import run
from autosp.models import build_model
from baselines.single import SingleTrainStep
from tests.nonfinite_method import PLANTED

MODULE = "tests.nonfinite_method"


@pytest.mark.parametrize("method, world_size", [("single", 1), ("autosp", 2), ("zero3", 2)])
def test_an_inf_gradient_in_the_last_step_is_an_error_naming_the_parameter(method, world_size) -> None:
    cfg = RunConfig(method=f"{method}-inf-grad", model="tiny", seq_len=64, world_size=world_size, steps=1, warmup=1,
                    compile_backend="aot_eager", timeout_s=300)
    record = run(cfg, extra_imports=[MODULE])
    assert record["status"] == "error", record
    last = cfg.warmup + cfg.steps  # steps are numbered from 0: warm-up, the measured step, the timed ones
    assert record["error"].endswith(f"gradient of {PLANTED} is not finite at step {last}: training diverged; "
                                    "use --dtype float32 or bfloat16, or a lower --lr"), record["error"]
    assert "\n" not in record["error"]


def test_the_first_nonfinite_gradient_is_the_first_in_the_model_order() -> None:
    step = SingleTrainStep(build_model("tiny", seed=0), torch.device("cpu"), lr=1e-3)
    params = dict(step.model.named_parameters())
    assert step.first_nonfinite() == (len(params), list(params))  # no gradients yet: nothing to flag
    for p in params.values():
        p.grad = torch.zeros_like(p)
    assert step.first_nonfinite()[0] == len(params)
    params[PLANTED].grad.view(-1)[-1] = float("inf")
    params["model.layers.0.self_attn.q_proj.weight"].grad.view(-1)[3] = float("nan")
    index, names = step.first_nonfinite()
    assert names[index] == "model.layers.0.self_attn.q_proj.weight"
