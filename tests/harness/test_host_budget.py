"""`--host-memory-budget`: host memory is a budget like the device's; no method wins by unbounded offload."""
import pytest

from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.runner import run


def test_offloading_past_the_host_budget_is_oom_naming_the_host() -> None:
    cfg = RunConfig("autosp", "tiny", 256, world_size=2, steps=1, warmup=0, compile_backend="aot_eager",
                    offload="activations", host_memory_budget=1024, timeout_s=300)
    record = run(cfg)
    assert record["status"] == "oom", record["error"]
    assert record["error"].startswith("host memory: the node's ranks offload"), record["error"]
    assert record["config"]["host_memory_budget"] == 1024
    assert record["extra"]["memory"]["host_offloaded_bytes"] > 512  # each rank's share is above half the budget
    # what a search's line follows where host memory binds (`autosp.experiments.search.binding_peak`)
    assert record["extra"]["node_host_bytes"] > record["extra"]["host_budget_bytes"] == 1024
    assert record["extra"]["oom_in"] == "host"


def test_the_host_budget_is_a_positive_size_and_unset_options_keep_older_hashes() -> None:
    with pytest.raises(ConfigError, match="--host-memory-budget must be positive"):
        RunConfig("autosp", "tiny", 256, host_memory_budget=0)
    from autosp.harness.strategy import get_strategy

    # as its records and the CLI hold it (`own_config`: autosp's options as before the default moved)
    plain = get_strategy("ulysses").own_config(RunConfig("ulysses", "tiny", 256))
    assert plain.config_hash() == "c315f26f23a836b4"  # its hash before --ac and --host-memory-budget existed
    assert plain.config_hash() != plain.replace(host_memory_budget=2**40).config_hash()
    assert plain.config_hash() != plain.replace(ac="layer").config_hash()


def test_a_ranks_node_is_the_launchers_local_world_size(monkeypatch) -> None:
    """The ranks sharing a node's host memory: LOCAL_WORLD_SIZE where a launcher (or the simulator, as a node of
    the device it simulates) set it, else every rank of a CPU run."""
    import torch
    import torch.distributed as dist

    from autosp.harness.measure import ranks_on_this_node

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        assert ranks_on_this_node(torch.device("cpu")) == 1
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
        assert ranks_on_this_node(torch.device("cpu")) == 8
    finally:
        dist.destroy_process_group()
