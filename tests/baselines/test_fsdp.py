import pytest

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.strategy import get_strategy
from tests.baselines.checking import check_config


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_matches_single_process_with_uneven_ignored_labels(checks, world_size: int) -> None:
    checks.passed(_fsdp(world_size))


def _fsdp(world_size: int) -> RunConfig:
    return check_config("fsdp", world_size, ignore_fraction=0.3)


def test_fsdp_rejects_sequence_parallel() -> None:
    with pytest.raises(ConfigError, match="data parallel only"):
        get_strategy("fsdp").validate(RunConfig("fsdp", "tiny", 128, world_size=2, sp_size=2), 4, 2)


#: each test that checks through `checks` (tests/baselines/checking.py): its configuration from its parameters
CONFIGS = {"test_fsdp_matches_single_process_with_uneven_ignored_labels": _fsdp}
