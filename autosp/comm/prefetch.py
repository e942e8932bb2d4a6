"""ZeRO stages 2/3: each decoder layer's parameters gathered in one collective, issued one layer ahead.

After partitioning, the forward graph (and at stage 3 the backward graph, where the partitioner re-runs the
gathers) holds one blocking `autosp::all_gather_shard` per parameter, where the parameter is used. This pass
turns each layer's run of gathers into a *bucket*:

  issue   the layer's shards concatenated (cast to the compute dtype once) and all-gathered as one asynchronous
          functional collective (`_c10d_functional.all_gather_into_tensor`), issued where the *previous* layer
          waits for its own bucket, so layer k+1's gather is in flight while layer k computes (FSDP2's default
          prefetch of one layer) -- `ahead=False`: issued where the layer starts, i.e. not overlapped;
  wait    `wait_tensor` where the layer's first gather stood; the gathered [P, sum of shard sizes] buffer is split
          back into each parameter's flat [P * shard] value (one copy each, as FSDP2's copy-out).

Layers are read off Dynamo's module stack (the gather runs in the parametrization of the module that uses the
parameter); a run of gathers outside the layers (embedding, final norm, LM head) is one bucket.

Buffers: every tensor a gather reads or writes is an input or output of the functional collective, held by its
Work until `wait_tensor`; at stage 3 at most two layers' gathered parameters are alive at once.

Where the gathers are issued ahead: on NCCL (and any backend but gloo). On gloo they are bucketed but issued
where the layer starts (`gathers_ahead`): a per-parameter version of this prefetch corrupted the heap at stage 3
on gloo (SIGABRT `malloc(): unaligned tcache chunk detected` in 6 of 9 fresh-compile runs of `autosp bench
--methods autosp --zero 3 --model small --seq-lens 4096 --world-size 2 --compile-backend aot_eager`, none without
it); the cause was not found (see DESIGN.md), so gloo keeps the concurrency it was measured safe with: a layer's
gather overlaps only the gradient buckets in flight, never the layer before it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from autosp.comm.sharding import fake_value, graph_call
from autosp.compiler.sac import layer_of_path, module_path

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
_GATHER = "autosp.all_gather_shard"


@dataclass(frozen=True)
class GatherBucket:
    """One all-gather of a partitioned graph: its layer (None: model-level parameters), how many parameters it
    gathers and whether it was issued ahead of the layer that uses it."""

    layer: str | None
    num_params: int
    prefetched: bool


def gathers_ahead(group: dist.ProcessGroup) -> bool:
    """Whether a layer's gather may be issued during the previous layer on `group`'s backend (see above)."""
    return dist.get_backend(group) != "gloo"


def prefetch_gathers(gm: fx.GraphModule, *, ahead: bool) -> list[GatherBucket]:
    """Rewrite `gm` in place (see the module docstring); returns its gather buckets in graph order."""
    graph = gm.graph
    buckets: list[list[fx.Node]] = []
    for node in graph.nodes:
        if node.op == "call_function" and str(node.target).startswith(_GATHER):
            if buckets and _bucket_key(buckets[-1][0]) == _bucket_key(node):
                buckets[-1].append(node)
            else:
                buckets.append([node])
    order = {node: i for i, node in enumerate(graph.nodes)}
    layers = [_bucket_key(bucket[0])[0] for bucket in buckets]
    previous_wait: fx.Node | None = None
    prefetched = []
    for k, bucket in enumerate(buckets):
        # ahead of the previous layer, unless a shard is computed only after that layer starts
        early = ahead and k > 0 and all(order[node.args[0]] < order[buckets[k - 1][0]] for node in bucket)
        issued = _issue(graph, bucket, before=previous_wait if early else bucket[0])
        previous_wait = _wait(graph, bucket, issued)
        prefetched.append(early)
    graph.lint()
    gm.recompile()
    return [GatherBucket(layer, len(b), early) for layer, b, early in zip(layers, buckets, prefetched)]


def _bucket_key(node: fx.Node) -> tuple:
    """Gathers of one bucket: one layer, one group, one compute dtype and one master dtype."""
    shard, group_size, group_name, _dp_size, _regather, dtype = node.args
    path = module_path(node)
    layer = layer_of_path(path.split(".parametrizations.")[0] if path else path)
    return layer, group_size, group_name, dtype, fake_value(shard).dtype


def _issue(graph: fx.Graph, bucket: list[fx.Node], before: fx.Node) -> fx.Node:
    """The bucket's shards, concatenated and cast, all-gathered asynchronously before `before`."""
    shards = [node.args[0] for node in bucket]
    _layer, group_size, group_name, dtype, master_dtype = _bucket_key(bucket[0])
    with graph.inserting_before(before):
        flat = shards[0] if len(shards) == 1 else graph_call(graph, aten.cat.default, shards)
        if master_dtype != dtype:  # mixed precision: communicate in the compute dtype
            flat = graph_call(graph, aten._to_copy.default, flat, dtype=dtype)
        return graph_call(graph, c10d.all_gather_into_tensor.default, flat, group_size, group_name)


def _wait(graph: fx.Graph, bucket: list[fx.Node], issued: fx.Node) -> fx.Node:
    """Wait where the bucket's first gather stood and hand each gather's users its parameter's flat value."""
    group_size = bucket[0].args[1]
    sizes = [fake_value(node.args[0]).numel() for node in bucket]
    with graph.inserting_before(bucket[0]):
        waited = graph_call(graph, c10d.wait_tensor.default, issued)
        rows = waited if len(bucket) == 1 else graph_call(graph, aten.view.default, waited, [group_size, -1])
        offset = 0
        for node, size in zip(bucket, sizes):
            full = waited
            if len(bucket) > 1:  # rank r's piece of this parameter is row r's columns [offset, offset + size)
                piece = graph_call(graph, aten.slice.Tensor, rows, 1, offset, offset + size)
                full = graph_call(graph, aten.view.default, graph_call(
                    graph, aten.clone.default, piece, memory_format=torch.contiguous_format), [-1])
            full.meta.update({key: v for key, v in node.meta.items() if key != "val"})
            node.replace_all_uses_with(full)
            offset += size
    for node in bucket:
        graph.erase_node(node)
    return waited
