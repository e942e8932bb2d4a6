"""The baselines' per-layer activation checkpointing (`--ac layer`): exact, and really keeping less for backward."""
import pytest
import torch

from autosp.harness.config import ConfigError, RunConfig
from autosp.models.build import build_model
from baselines.checkpointing import apply_activation_checkpointing
from tests.baselines.checking import check_config


def saved_bytes(model: torch.nn.Module, input_ids: torch.Tensor) -> int:
    """Bytes forward saves for backward, parameters excluded (deduplicated by storage)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=input_ids).logits.sum().backward()
    return sum(storages.values())


@pytest.mark.parametrize("model_name", ["tiny", "hf:tiny"])
def test_layer_checkpointing_keeps_only_the_layer_inputs_and_computes_the_same_gradients(model_name: str) -> None:
    input_ids = torch.randint(0, 512, (1, 256))
    plain, checkpointed = build_model(model_name), build_model(model_name)
    assert apply_activation_checkpointing(plain, RunConfig("single", model_name, 256)) == ""
    assert apply_activation_checkpointing(checkpointed, RunConfig("ulysses", model_name, 256, ac="layer")) == "+ac"
    plain_bytes, checkpointed_bytes = saved_bytes(plain, input_ids), saved_bytes(checkpointed, input_ids)
    assert checkpointed_bytes < plain_bytes / 2, (checkpointed_bytes, plain_bytes)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ulysses", "zero3"])
def test_checkpointed_baselines_equal_single_process_training(checks, method: str) -> None:
    """--ac layer under both sharding stacks: ulysses at its default ZeRO 3 checkpoints before FSDP2 wraps the layers
    (as ring and fsdp do), zero3 inside DeepSpeed's ZeRO-3 engine."""
    report = checks.passed(_checkpointed(method))
    assert report.status == "ok"


def _checkpointed(method: str) -> RunConfig:
    return check_config(method, 2, ac="layer")


def test_ac_takes_off_or_layer_only() -> None:
    with pytest.raises(ConfigError, match="--ac must be one of off, layer"):
        RunConfig("ulysses", "tiny", 64, ac="full")


#: each test that checks through `checks` (tests/baselines/checking.py): its configuration from its parameters
CONFIGS = {"test_checkpointed_baselines_equal_single_process_training": _checkpointed}
