import pytest

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.strategy import get_strategy
from tests.baselines.checking import assert_check_passes


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_matches_single_process_with_uneven_ignored_labels(world_size: int) -> None:
    assert_check_passes("fsdp", world_size, ignore_fraction=0.3)


def test_fsdp_rejects_sequence_parallel() -> None:
    with pytest.raises(ConfigError, match="data parallel only"):
        get_strategy("fsdp").validate(RunConfig("fsdp", "tiny", 128, world_size=2, sp_size=2), 4, 2)
