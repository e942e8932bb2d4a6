import pytest

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.strategy import get_strategy
from tests.baselines.gloo import run_ranks


@pytest.mark.parametrize("method", ["zero3", "ulysses", "ulysses-compile", "ds-autosp"])
def test_deepspeed_methods_say_when_deepspeed_is_missing(method: str, monkeypatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real_find_spec(n, *a))
    with pytest.raises(ConfigError, match="needs DeepSpeed, which is not installed"):
        get_strategy(method).validate(RunConfig(method, "tiny", 64, world_size=2), 4, 2)


def _init_without_shm_build(rank: int, world_size: int) -> None:
    import deepspeed.comm

    from baselines.deepspeed_env import SHM_COMM_OP, import_deepspeed

    deepspeed = import_deepspeed("zero3")
    assert deepspeed.comm.is_initialized()
    assert deepspeed.ops.__compatible_ops__[SHM_COMM_OP] is False
    assert deepspeed.comm.comm.cdb.shm_comm_op is None  # the ~35 s JIT build was skipped


def test_gloo_init_skips_the_shared_memory_op_build() -> None:
    run_ranks(2, _init_without_shm_build)
