import pytest

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.strategy import get_strategy
from tests.baselines.checking import check_config
from tests.baselines.gloo import run_ranks


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero3_matches_single_process_with_uneven_ignored_labels(checks, world_size: int) -> None:
    checks.passed(_zero3(world_size))


def _zero3(world_size: int) -> RunConfig:
    return check_config("zero3", world_size, ignore_fraction=0.3)


def test_zero3_rejects_sequence_parallel() -> None:
    with pytest.raises(ConfigError, match="data parallel only"):
        get_strategy("zero3").validate(RunConfig("zero3", "tiny", 128, world_size=2, sp_size=2), 4, 2)


def _every_parameter_partitioned(rank: int, world: int) -> None:
    import torch

    from autosp.harness.parallel import build_context
    from autosp.models import build_model

    cfg = RunConfig("zero3", "tiny", 64, world_size=world)
    step = get_strategy("zero3").setup(build_model("tiny"), build_context(1, torch.device("cpu")), cfg)
    for name, p in step.engine.module.named_parameters():
        # not kept whole ("persistent") on every rank: only a 1/world slice lives here between uses
        assert not p.ds_persist and p.data.numel() == 0, name
        assert p.ds_tensor.numel() == -(-p.ds_numel // world), name


def test_zero3_partitions_even_tiny_parameters() -> None:
    run_ranks(2, _every_parameter_partitioned)



def test_zero3_buckets_never_exceed_the_model() -> None:
    from baselines.zero3 import DEFAULT_REDUCE_BUCKET, zero3_config

    zero = zero3_config(RunConfig("zero3", "tiny", 64, world_size=2), num_params=1000)["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["stage3_prefetch_bucket_size"] == 1000
    big = zero3_config(RunConfig("zero3", "tiny", 64, world_size=2), num_params=8 * 10**9)["zero_optimization"]
    assert big["reduce_bucket_size"] == DEFAULT_REDUCE_BUCKET


#: each test that checks through `checks` (tests/baselines/checking.py): its configuration from its parameters
CONFIGS = {"test_zero3_matches_single_process_with_uneven_ignored_labels": _zero3}
