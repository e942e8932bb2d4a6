"""ZeRO stages 2/3: each decoder layer's parameters gathered in one collective, issued one layer ahead.

After partitioning, the forward graph (and at stage 3 the backward graph, where the partitioner re-runs the
gathers) holds one blocking `autosp_sp::all_gather_shard` per parameter, where the parameter is used. This pass
turns each layer's run of gathers into a *bucket*:

  issue   the layer's shards (cast to the compute dtype) all-gathered as one asynchronous coalesced functional
          collective (`_c10d_functional.all_gather_into_tensor_coalesced`), issued where the *previous* layer
          waits for its own bucket, so layer k+1's gather is in flight while layer k computes (FSDP2's default
          prefetch of one layer), on every backend; a bucket with a shard computed only after the previous layer
          starts is issued where its layer starts;
  wait    `wait_tensor` where the layer's first gather stood; each output is one parameter's flat [P * shard]
          value, as the per-parameter gather returned it (gloo flattens and unflattens on its worker thread; NCCL
          groups the gathers into one launch).

With the parameters in host memory (offload=params, `autosp.comm.host_params`) each shard is first fetched to the
device; the fetches move with their bucket's issue, so the copies of layer k+1 are also made during layer k.

Layers are read off Dynamo's module stack (the gather runs in the parametrization of the module that uses the
parameter); a run of gathers outside the layers (embedding, final norm, LM head) is one bucket.

Buffers: every tensor a gather reads or writes is an input or output of the functional collective, held by its
Work until `wait_tensor`; at stage 3 at most two layers' gathered parameters are alive at once. No buffer is made
in the graph only to be handed to the collective (no concatenated copy of the shards): the Work may drop its last
reference on gloo's worker thread, where the CPU memory meter does not see the free (autosp/harness/measure.py), so
such a buffer made the measured peaks vary from run to run (93.8-99.4 MiB over 11 runs of small at S=4096).

Gloo: an earlier per-parameter version of this prefetch aborted at stage 3 on gloo (`malloc(): unaligned tcache
chunk detected`, cause not found); the bucketed one, issued ahead, ran clean in every fresh-compile stress run on
gloo, so gloo is not an exception -- on a loaded machine where the old version did not abort either (DESIGN.md).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autosp.comm.library import op_name
from autosp.compiler.fx.nodes import fake_value, graph_call
from autosp.compiler.fx.layers import layer_of_path, module_path

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


@dataclass(frozen=True)
class GatherBucket:
    """One all-gather of a partitioned graph: its layer (None: model-level parameters), how many parameters it
    gathers and whether it was issued ahead of the layer that uses it."""

    layer: str | None
    num_params: int
    prefetched: bool


def prefetch_gathers(gm: fx.GraphModule) -> list[GatherBucket]:
    """Rewrite `gm` in place (see the module docstring); returns its gather buckets in graph order."""
    graph = gm.graph
    buckets: list[list[fx.Node]] = []
    for node in graph.nodes:
        if node.op == "call_function" and op_name(node.target) == "all_gather_shard":
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
        early = k > 0 and all(order[_source(node)] < order[buckets[k - 1][0]] for node in bucket)
        issued = _issue(graph, bucket, before=previous_wait if early else bucket[0])
        previous_wait = _wait(graph, bucket, issued)
        prefetched.append(early)
    graph.lint()
    gm.recompile()
    return [GatherBucket(layer, len(b), early) for layer, b, early in zip(layers, buckets, prefetched)]


def _is_fetch(node: fx.Node) -> bool:
    return node.op == "call_function" and op_name(node.target) == "fetch_parameter"


def _source(gather: fx.Node) -> fx.Node:
    """What a gather's shard is made from: the host shard where it is fetched first (offload=params, the fetch moves
    with the bucket's issue), else the shard itself."""
    shard = gather.args[0]
    return shard.args[0] if _is_fetch(shard) else shard


def _bucket_key(node: fx.Node) -> tuple:
    """Gathers of one bucket: one layer, one group, one compute dtype and one master dtype."""
    shard, group_size, group_name, _dp_size, _regather, dtype = node.args
    return layer_of_path(module_path(node)), group_size, group_name, dtype, fake_value(shard).dtype


def _issue(graph: fx.Graph, bucket: list[fx.Node], before: fx.Node) -> fx.Node:
    """The bucket's shards (cast to the compute dtype) all-gathered as one coalesced collective before `before`."""
    _layer, group_size, group_name, dtype, master_dtype = _bucket_key(bucket[0])
    shards = [node.args[0] for node in bucket]
    for shard in shards:
        if _is_fetch(shard):  # the host -> device copy goes with the gather it feeds
            before.prepend(shard)
    with graph.inserting_before(before):
        if master_dtype != dtype:  # mixed precision: communicate in the compute dtype
            shards = [graph_call(graph, aten._to_copy.default, shard, dtype=dtype) for shard in shards]
        return graph_call(graph, c10d.all_gather_into_tensor_coalesced.default, shards, group_size, group_name)


def _wait(graph: fx.Graph, bucket: list[fx.Node], issued: fx.Node) -> fx.Node:
    """Wait where the bucket's first gather stood; each output is that parameter's flat [P * shard] value."""
    with graph.inserting_before(bucket[0]):
        waits = []
        for i, node in enumerate(bucket):
            full = graph_call(graph, c10d.wait_tensor.default, graph_call(graph, operator.getitem, issued, i))
            full.meta.update({key: v for key, v in node.meta.items() if key != "val"})
            node.replace_all_uses_with(full)
            waits.append(full)
    for node in bucket:
        graph.erase_node(node)
    return waits[0].args[0]
