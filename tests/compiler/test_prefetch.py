"""The per-layer gather buckets of ZeRO stages 2/3 on a hand-built partitioned graph (no process group): one
all-gather per layer, issued during the previous layer unless a shard is computed only inside it."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import autosp.comm.ops  # noqa: F401  (registers autosp_sp::all_gather_shard)
from autosp.compiler.zero.prefetch import GatherBucket, prefetch_gathers


def _two_layer_graph(late_shard: bool = False) -> fx.GraphModule:
    """layers.0 uses shards s0, s1 and layers.1 uses s2, s3; each layer gathers its parameters where it uses them.
    `late_shard`: layers.1's first shard is computed after layers.0's compute (a copy of s2 made there)."""
    graph, fake = fx.Graph(), FakeTensorMode()
    shards = []
    for i, numel in enumerate((3, 5, 2, 4)):
        shard = graph.placeholder(f"s{i}")
        shard.meta["val"] = fake.from_tensor(torch.zeros(numel))
        shards.append(shard)
    outputs = []
    for layer in (0, 1):
        h = None
        if late_shard and layer == 1:
            late = graph.call_function(torch.ops.aten.clone.default, (shards[2],))
            late.meta["val"] = torch.ops.aten.clone.default(shards[2].meta["val"])
            shards[2] = late
        for i in (2 * layer, 2 * layer + 1):
            stack = {"m": (f"L['self'].layers.{layer}.proj{i}.parametrizations.weight", torch.nn.Linear)}
            gather = graph.call_function(torch.ops.autosp_sp.all_gather_shard.default,
                                         (shards[i], 2, "0", 1, True, torch.float32))
            gather.meta.update(nn_module_stack=stack, val=torch.ops.autosp_sp.all_gather_shard.default(
                shards[i].meta["val"], 2, "0", 1, True, torch.float32))
            use = graph.call_function(torch.ops.aten.sum.default, (gather,))
            use.meta["val"] = torch.ops.aten.sum.default(gather.meta["val"])
            h = use if h is None else graph.call_function(torch.ops.aten.add.Tensor, (h, use))
        outputs.append(h)
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _targets(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_each_layer_is_one_gather_issued_during_the_layer_before():
    gm = _two_layer_graph()
    buckets = prefetch_gathers(gm)
    assert [(b.layer.rsplit(".", 1)[-1], b.num_params, b.prefetched) for b in buckets] == [("0", 2, False),
                                                                                          ("1", 2, True)]
    assert all(isinstance(b, GatherBucket) for b in buckets)
    ops = _targets(gm)
    issued = [i for i, t in enumerate(ops) if "all_gather_into_tensor" in t]
    waits = [i for i, t in enumerate(ops) if "wait_tensor" in t]
    sums = [i for i, t in enumerate(ops) if t == "aten.sum.default"]
    assert not any("autosp_sp.all_gather_shard" in t for t in ops)
    assert len(issued) == 2 and len(waits) == 4  # one collective per layer, one wait per parameter
    # layer 1's gather is in flight before layer 0 waits for its own, and waited only after layer 0's compute
    assert issued[1] < waits[0] < sums[1] < waits[2] < sums[2]
    # each parameter's users now read the coalesced gather's output of the right size, [P * shard]
    full = [n for n in gm.graph.nodes if "wait_tensor" in str(n.target)]
    assert [n.meta["val"].numel() for n in full] == [6, 10, 4, 8]


def test_a_shard_computed_inside_the_previous_layer_is_gathered_where_its_layer_starts():
    gm = _two_layer_graph(late_shard=True)
    buckets = prefetch_gathers(gm)
    assert [b.prefetched for b in buckets] == [False, False]
    ops = _targets(gm)
    issued = [i for i, t in enumerate(ops) if "all_gather_into_tensor" in t]
    sums = [i for i, t in enumerate(ops) if t == "aten.sum.default"]
    assert sums[1] < issued[1] < sums[2]  # after all of layer 0's compute


def test_a_parameters_layer_is_found_in_a_walk_that_visits_each_node_once():
    """Gradient bucketing asks each parameter for its layer; where its users carry no module stack (the tiled MLP's
    tile ops) the walk goes downstream. Through 18 diamonds (2^18 paths) it must visit each node once (following
    every path took minutes)."""
    import time

    from autosp.compiler.zero.grad_buckets import _layer_of

    graph = fx.Graph()
    weight = node = graph.placeholder("w")
    for _ in range(18):
        left = graph.call_function(torch.ops.aten.neg.default, (node,))
        right = graph.call_function(torch.ops.aten.relu.default, (node,))
        node = graph.call_function(torch.ops.aten.add.Tensor, (left, right))
    node.meta["nn_module_stack"] = {"m": ("L['self'].model.layers.3.mlp", torch.nn.Module)}
    graph.output(node)
    started = time.monotonic()
    assert _layer_of(weight) == "L['self'].model.layers.3" and time.monotonic() - started < 5.0
