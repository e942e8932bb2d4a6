import pytest

import baselines.fsdp  # noqa: F401  (registers the method)
from autosp.config import ConfigError, RunConfig
from baselines.base import get_strategy
from tests.baselines.gloo import run_ranks
from tests.baselines.reference import compare_with_single


@pytest.mark.parametrize("world,ignore", [(2, 0.3), (4, 0.3)])
def test_fsdp_matches_single_process(world: int, ignore: float) -> None:
    run_ranks(world, compare_with_single, "fsdp", "tiny", 128, ignore)


def test_fsdp_rejects_sequence_parallel() -> None:
    with pytest.raises(ConfigError, match="data parallel only"):
        get_strategy("fsdp").validate(RunConfig("fsdp", "tiny", 128, world_size=2, sp_size=2), 4, 2)
