import pytest
import torch

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.parallel import build_context
from autosp.harness.strategy import get_strategy
from autosp.models import build_model
from autosp.models.data import make_batch


def test_single_trains_in_process_and_exposes_full_state() -> None:
    cfg = RunConfig(method="single", model="tiny", seq_len=32, lr=1e-2)
    step = get_strategy("single").setup(build_model("tiny", seed=0), build_context(1, torch.device("cpu")), cfg)
    batch = make_batch(cfg.data, batch_size=1, seq_len=32, vocab_size=512, seed=0)
    before = step.full_parameters()
    loss = step.forward_backward(batch)
    grads = step.full_gradients()
    assert loss.requires_grad is False and grads.keys() == before.keys()
    assert all(g.abs().sum() > 0 for g in grads.values())
    step.optimizer_step()
    after = step.full_parameters()
    assert all(not after[n].equal(before[n]) for n in before)  # AdamW moved every parameter
    assert all(g.abs().sum() == 0 for g in step.full_gradients().values())  # gradients were zeroed
    assert float(step.forward_backward(batch)) < float(loss)


@pytest.mark.parametrize("change,message", [({"world_size": 2}, "runs on one rank"),
                                            ({"sp_size": 2}, "no sequence parallelism")])
def test_single_rejects_parallel_layouts(change, message) -> None:
    with pytest.raises(ConfigError, match=message):
        get_strategy("single").validate(RunConfig(method="single", model="tiny", seq_len=64, **change), 4, 2)
