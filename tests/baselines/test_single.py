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


@pytest.mark.parametrize("model", ["tiny", "hf:tiny"])
def test_single_with_layer_checkpointing_keeps_layer_inputs_only_and_equals_single(model) -> None:
    """single[ac=layer] (HF-style gradient checkpointing, the one-GPU practitioners' baseline): the same gradients,
    far fewer bytes saved for backward."""
    grads, saved = {}, {}
    for ac in ("off", "layer"):
        cfg = RunConfig(method="single", model=model, seq_len=64, ac=ac)
        step = get_strategy("single").setup(build_model(model, seed=0), build_context(1, torch.device("cpu")), cfg)
        batch = make_batch(cfg.data, batch_size=1, seq_len=64, vocab_size=512, seed=0)
        storages = {}

        def pack(t, storages=storages):
            if not isinstance(t, torch.nn.Parameter):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step.forward_backward(batch)
        grads[ac], saved[ac] = step.full_gradients(), sum(storages.values())
        assert ("+ac" in step.implementation) == (ac == "layer")
    assert all(torch.allclose(grads["off"][n], grads["layer"][n], atol=1e-6) for n in grads["off"])
    assert saved["layer"] < saved["off"] / 2, saved
