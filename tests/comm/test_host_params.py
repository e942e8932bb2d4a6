"""`autosp.comm.host_params` on one process: the fetch copies a host shard to the device and its gradient back to
host memory, the `params` offload item and its one-line refusals. (Training against single-process training at
one rank and at ZeRO 3 over gloo ranks, and the bytes the meter books: tests/baselines/test_autosp_method.py.)"""
from __future__ import annotations

import pytest
import torch

from autosp.comm.host_params import fetch_parameter, gradient_to_host, place_on_host
from autosp.compiler.memory import OffloadPlan
from autosp.compiler.options import CompileOptions
from autosp.errors import ConfigError


def test_the_fetch_copies_to_the_device_and_its_gradient_comes_back_as_a_fresh_host_copy():
    host = torch.arange(6, dtype=torch.float32).requires_grad_()
    fetched = fetch_parameter(host, torch.device("cpu"))
    assert torch.equal(fetched, host) and fetched.data_ptr() != host.data_ptr()  # a copy, never the host storage
    weight = torch.arange(6.0) + 1
    (fetched * weight).sum().backward()
    assert torch.equal(host.grad, weight)
    grad = torch.ones(3)
    copied = gradient_to_host(grad)
    assert torch.equal(copied, grad) and copied.data_ptr() != grad.data_ptr()


def test_the_fetch_refuses_a_device_it_cannot_copy_to_in_one_line():
    with pytest.raises(Exception, match="offload=params runs on CUDA/ROCm .* or CPU") as info:
        fetch_parameter(torch.ones(2), torch.device("meta"))
    assert "\n" not in str(info.value).strip()


def test_placing_on_host_keeps_the_parameter_object_and_its_values():
    p = torch.nn.Parameter(torch.randn(4, 3))
    before = p.detach().clone()
    place_on_host([p, p])
    assert torch.equal(p, before) and isinstance(p, torch.nn.Parameter)


def test_the_host_budget_counts_the_parameters_and_their_gradients_beside_the_adamw_state():
    from autosp.comm.host_optimizer import HostMemoryError, check_host_budget

    assert check_host_budget(10, torch.float32, None, params_dtype=torch.bfloat16) == 10 * (16 + 2 * 2)
    with pytest.raises(HostMemoryError, match="and the parameters with their gradients"):
        check_host_budget(10, torch.float32, 199, params_dtype=torch.bfloat16)


def test_the_params_item_sits_beside_the_others_and_needs_the_optimizer_item():
    assert OffloadPlan.parse("auto,optimizer,params") == OffloadPlan("auto", "on", "on", "auto")
    assert OffloadPlan.parse("params,optimizer:torch").params == "on"
    assert OffloadPlan.parse("auto,optimizer").params == "off"
    assert CompileOptions(offload="optimizer,params").host_params
    with pytest.raises(ConfigError, match="add optimizer") as info:
        CompileOptions(offload="auto,params")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="unknown --offload"):
        OffloadPlan.parse("optimizer,params,params")


def _zero3_rank() -> dict:
    import autosp
    from autosp.harness.config import DataConfig
    from autosp.models import build_model
    from autosp.models.data import make_batch

    compiled = autosp.compile(build_model("tiny", seed=0), backend="aot_eager", sac="sac", zero=3,
                              offload="optimizer:torch,params")
    batch = make_batch(DataConfig(), batch_size=1, seq_len=64, vocab_size=256, seed=0)
    compiled(**batch.model_kwargs()).loss.backward()
    (record,) = compiled.partition_records

    def count(graph: torch.fx.GraphModule, name: str) -> int:
        return sum(f"autosp_sp.{name}" in str(n.target) for n in graph.graph.nodes)

    return {"fetches": (count(record.fw_module, "fetch_parameter"), count(record.bw_module, "fetch_parameter")),
            "to_host": count(record.bw_module, "gradient_to_host"),
            "params": len(list(compiled.parameters())),
            "prefetched": [[b.prefetched for b in graph] for graph in compiled.gather_buckets]}


def test_at_zero_3_every_shard_is_fetched_in_forward_and_again_in_backward_and_gathers_still_go_a_layer_ahead():
    """Two gloo ranks: one fetch per shard in forward and again in backward (the partitioner re-runs it, never keeps a
    device copy from forward), one gradient copy to host per shard in backward, and every layer's gather bucket but
    the first of each graph still issued during the previous layer (the fetches move with it)."""
    from autosp.harness.launch import launch

    outcome = launch(_zero3_rank, world_size=2, timeout_s=300)
    assert outcome.status == "ok", outcome.traceback
    result = outcome.results[0]
    # backward needs every parameter again but the embedding table (its gradient needs only the token ids)
    assert result["fetches"] == (result["params"], result["params"] - 1) and result["to_host"] == result["params"]
    for graph in result["prefetched"]:
        assert len(graph) > 2 and not graph[0] and all(graph[1:]), result["prefetched"]
