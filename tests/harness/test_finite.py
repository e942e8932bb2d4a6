"""A non-finite gradient is an `error` in the step that makes it, naming the first such parameter (every rank
agrees), for methods whose gradients live in `.grad`, in AutoSP's ZeRO-3 shards and in DeepSpeed's partitions."""
import pytest

from autosp.harness.config import RunConfig
from autosp.harness.runner import run
from tests.nonfinite_method import PLANTED

MODULE = "tests.nonfinite_method"


@pytest.mark.parametrize("method, world_size", [("single", 1), ("autosp", 2), ("zero3", 2)])
def test_an_inf_gradient_in_the_last_step_is_an_error_naming_the_parameter(method, world_size) -> None:
    cfg = RunConfig(method=f"{method}-inf-grad", model="tiny", seq_len=64, world_size=world_size, steps=1, warmup=1,
                    timeout_s=300)
    record = run(cfg, extra_imports=[MODULE])
    assert record["status"] == "error", record
    last = cfg.warmup + cfg.steps  # steps are numbered from 0: warm-up, the measured step, the timed ones
    assert record["error"].endswith(f"gradient of {PLANTED} is not finite at step {last}: training diverged; "
                                    "use --dtype float32 or bfloat16, or a lower --lr"), record["error"]
    assert "\n" not in record["error"]
