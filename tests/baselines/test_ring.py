import pytest
import torch

from autosp.harness.config import ConfigError, DataConfig, RunConfig
from autosp.harness.strategy import get_strategy
from baselines.ring import choose_ring
from tests.baselines.checking import check_config


@pytest.mark.parametrize("world_size, options", [
    (4, dict(ignore_fraction=0.3, zero=3)),  # GQA: 2 KV heads travel the ring, 4 ranks; FSDP2 shards every layer
    (4, dict(sp_size=2, ignore_fraction=0.3, batch_size=2, zero=0)),  # 2 rings x 2 data-parallel replicas
])
def test_ring_matches_single_process(checks, world_size: int, options: dict) -> None:
    checks.passed(_ring(world_size, options))


def _ring(world_size: int, options: dict) -> RunConfig:
    return check_config("ring", world_size, **options)


def test_ring_on_cpu_runs_the_torch_ring() -> None:
    implementation, reason, _ = choose_ring(torch.device("cpu"), torch.float32, None)
    assert implementation == "torch-ring" and "cpu" in reason


@pytest.mark.parametrize("cfg, message", [
    (RunConfig("ring", "tiny", 102, world_size=2), "multiple of 4"),
    (RunConfig("ring", "tiny", 128, world_size=2, data=DataConfig(packed_documents=2)), "plain causal"),
])
def test_ring_rejects_what_it_cannot_run(cfg: RunConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        get_strategy("ring").validate(cfg, 4, 2)


#: each test that checks through `checks` (tests/baselines/checking.py): its configuration from its parameters
CONFIGS = {"test_ring_matches_single_process": _ring}
