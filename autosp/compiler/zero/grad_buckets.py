"""The gradient-bucketing pass: gradients reduced over every rank holding a replica (summed over SP ranks, averaged
over DP replicas) from inside the backward graph, in buckets.

Each SP rank back-propagates only through its own tokens, so a parameter's gradient is the sum of the ranks'
gradients; data-parallel replicas (each averaging its own batch) are averaged. The reduction runs in *buckets* of
gradients, issued from inside the compiled backward graph right after the bucket's last gradient is produced, as one
asynchronous functional collective (`_c10d_functional`) per bucket, waited for once the next bucket is issued: a
bucket's reduction overlaps the backward that follows it, and at most two buckets' buffers are alive at once.

  stages 0/1  buckets filled as DDP fills them: consecutive gradients across layers, the first bucket at most
              `FIRST_BUCKET_BYTES` (DDP's 1 MiB, so the first reduction starts early in backward), the others at
              most `BUCKET_BYTES`; each bucket's gradients flattened into one buffer and all-reduced. Few
              collectives: on a small model, one per step, since each costs a fixed latency whatever its size;
  stages 2/3  one bucket per decoder layer (at most `BUCKET_BYTES`), as FSDP2 reduces per sharded module: the
              graph already reduce-scatters each parameter's gradient (the backward of `all_gather_shard`), and a
              layer's reduce-scatters become one: the full gradients viewed [P, shard], concatenated along the
              shard dim, reduce-scattered once, and split back into each parameter's shard. Per layer, because
              the full gradients are what stages 2/3 exist to not keep: each layer's are freed before the next
              layer's are all made.

Why a joint-graph pass inside the partition function (not hooks): under aot_autograd the whole backward is one
compiled autograd node, so tensor or post-accumulate-grad hooks all fire after it ends: a hook can only start
the reductions after backward, never overlap them with it. The pass sees every gradient where the backward
produces it, and the partitioner places the collectives into the backward graph (never recomputed: they depend
on the tangents). The reduction happens before autograd accumulates into `.grad`, so gradient accumulation over
several backward calls stays exact. Backend `eager` builds no joint graph; there `autosp.comm.grad_sync` keeps one
tensor hook per parameter (a debugging path, unbucketed).
"""
from __future__ import annotations

import collections
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from autosp.comm.library import op_name
from autosp.compiler.fx.nodes import fake_value, graph_call, node_nbytes
from autosp.compiler.fx.layers import layer_of_path, module_path
from autosp.errors import SequenceParallelError

aten, c10d = torch.ops.aten, torch.ops._c10d_functional

#: Bytes at which a bucket is closed (DDP's default `bucket_cap_mb`).
BUCKET_BYTES = 25 * 2**20
#: The first bucket's cap at stages 0/1 (DDP's `first_bucket_bytes`).
FIRST_BUCKET_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES

@dataclass(frozen=True)
class GradientReduction:
    """Where and how gradients are reduced: over `group_name` (`group_size` ranks, SP x DP), divided by `dp_size`.
    `sharded` (ZeRO stages 2/3): the graph's per-parameter reduce-scatters are bucketed instead."""

    group_name: str
    group_size: int
    dp_size: int
    sharded: bool
    bucket_bytes: int = BUCKET_BYTES
    first_bucket_bytes: int = FIRST_BUCKET_BYTES


@dataclass
class Bucket:
    """One collective of the backward graph: the layers of its gradients in backward's order (None: model-level
    parameters) and parameter count."""

    layers: tuple[str | None, ...]
    num_params: int
    nbytes: int


@dataclass
class _Entry:
    position: int  # the primal (graph input) whose gradient this is
    full: fx.Node  # the rank's local gradient (stages 0/1) or the full flat gradient to reduce-scatter (2/3)
    replaced: fx.Node  # the node whose value the bucket's slice replaces
    layer: str | None
    order: int = 0


def bucket_gradient_reduction(
    joint_gm: fx.GraphModule, *, num_fwd_outputs: int, param_positions: Sequence[int],
    reduction: GradientReduction,
) -> list[Bucket]:
    """Rewrite the joint graph in place so the gradients of the primals at `param_positions` are reduced in
    buckets (see the module docstring); returns the buckets in the order backward issues them."""
    graph = joint_gm.graph
    primals = [n for n in graph.nodes if n.op == "placeholder" and not str(n.target).startswith("tangents")]
    (output,) = graph.find_nodes(op="output")
    grads = list(output.args[0][num_fwd_outputs:])
    if len(grads) != len(primals):
        raise SequenceParallelError(f"gradient bucketing: {len(grads)} gradients for {len(primals)} graph inputs")
    order = {node: i for i, node in enumerate(graph.nodes)}
    entries = []
    for position in param_positions:
        grad = grads[position]
        if not isinstance(grad, fx.Node):
            continue  # unused parameter: no gradient
        layer = _layer_of(primals[position])
        for replaced in _reduce_scatters_of(grad) if reduction.sharded else [grad]:
            full = replaced.args[0] if reduction.sharded else grad
            entries.append(_Entry(position, full, replaced, layer, order[full]))
    entries.sort(key=lambda e: e.order)
    buckets = list(_group(entries, reduction))
    issued = [_issue(graph, bucket, reduction) for bucket in buckets]
    for k, (bucket, (collective, sizes)) in enumerate(zip(buckets, issued)):
        # bucket k is waited for once bucket k+1 is issued: at most two reductions in flight, so their buffers (at
        # stages 2/3 the full gradients) do not pile up until the end of backward
        before = issued[k + 1][0].next if k + 1 < len(buckets) else output
        _wait(graph, bucket, collective, sizes, before, reduction, grads)
    if not reduction.sharded:
        output.args = (list(output.args[0][:num_fwd_outputs]) + grads, *output.args[1:])
    graph.lint()
    joint_gm.recompile()
    return [Bucket(tuple(dict.fromkeys(e.layer for e in b)), len(b), sum(node_nbytes(e.full) for e in b)) for b in buckets]


def _reduce_scatters_of(grad: fx.Node) -> list[fx.Node]:
    """The `autosp_sp::reduce_scatter_sum`s a shard's gradient is computed from (through the division by dp_size;
    a tied parameter is gathered once per use, so its gradient sums one reduce-scatter per use)."""
    found, stack, seen = [], [grad], set()
    while stack:
        node = stack.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if op_name(node.target) == "reduce_scatter_sum":
            found.append(node)
        else:
            stack.extend(node.all_input_nodes)
    if not found:
        raise SequenceParallelError(f"gradient bucketing: no reduce-scatter produces the gradient {grad.name}")
    return found


def _layer_of(primal: fx.Node) -> str | None:
    """The decoder layer whose code first uses this parameter (Dynamo's module stack), None outside the layers.
    Breadth-first, each node once: where users carry no module stack (the tiled MLP's tile ops) the walk goes on
    downstream, and without `seen` it followed every path of the graph's DAG (minutes per compile on `small`)."""
    frontier, seen = collections.deque(primal.users), set(primal.users)
    while frontier:
        node = frontier.popleft()
        if node.meta.get("nn_module_stack"):  # a ZeRO 2/3 gather runs in the parametrization of the module
            return layer_of_path(module_path(node))  # a parametrization is in its module's layer
        fresh = [user for user in node.users if user not in seen]
        seen.update(fresh)
        frontier.extend(fresh)
    return None


def _group(entries: list[_Entry], reduction: GradientReduction) -> Iterable[list[_Entry]]:
    """Consecutive gradients (in the order backward produces them) of one dtype, filled as the module docstring
    says for the stage: across layers at stages 0/1, one layer at stages 2/3."""
    bucket: list[_Entry] = []
    cap = reduction.bucket_bytes if reduction.sharded else reduction.first_bucket_bytes
    for entry in entries:
        dtype = fake_value(entry.full).dtype
        if bucket and ((reduction.sharded and entry.layer != bucket[0].layer)
                       or dtype != fake_value(bucket[0].full).dtype
                       or sum(node_nbytes(e.full) for e in bucket) + node_nbytes(entry.full) > cap):
            yield bucket
            bucket, cap = [], reduction.bucket_bytes
        bucket.append(entry)
    if bucket:
        yield bucket


def _issue(graph: fx.Graph, bucket: list[_Entry], reduction: GradientReduction) -> tuple[fx.Node, list[int]]:
    """Issue the bucket's collective right after its last gradient; returns it and the bucket's slice sizes."""
    p, name = reduction.group_size, reduction.group_name
    with graph.inserting_before(bucket[-1].full.next):  # (inserting_after would reverse the new nodes)
        if reduction.sharded:  # [P * s_i] each -> [P, sum s_i]: row r holds every parameter's shard r
            rows = [graph_call(graph, aten.view.default, _contiguous(graph, e.full), [p, -1]) for e in bucket]
            flat = graph_call(graph, aten.view.default, graph_call(graph, aten.cat.default, rows, 1), [-1])
            return (graph_call(graph, c10d.reduce_scatter_tensor.default, flat, "sum", p, name),
                    [fake_value(e.full).numel() // p for e in bucket])
        flats = [graph_call(graph, aten.view.default, _contiguous(graph, e.full), [-1]) for e in bucket]
        return (graph_call(graph, c10d.all_reduce.default, graph_call(graph, aten.cat.default, flats), "sum", name),
                [fake_value(e.full).numel() for e in bucket])


def _wait(graph: fx.Graph, bucket: list[_Entry], issued: fx.Node, sizes: list[int], before: fx.Node,
          reduction: GradientReduction, grads: list) -> None:
    """Wait for the bucket's collective before `before`, and hand its slices on as the gradients."""
    with graph.inserting_before(before):
        reduced = graph_call(graph, c10d.wait_tensor.default, issued)
        if not reduction.sharded and reduction.dp_size > 1:  # stages 2/3 divide after their reduce-scatter already
            reduced = graph_call(graph, aten.div.Tensor, reduced, reduction.dp_size)
        pieces = graph_call(graph, aten.split_with_sizes.default, reduced, sizes)
        for i, entry in enumerate(bucket):
            piece = graph_call(graph, operator.getitem, pieces, i)
            if not reduction.sharded:
                shape = list(fake_value(entry.full).shape)
                grads[entry.position] = graph_call(graph, aten.view.default, piece, shape)
                continue
            downstream = _downstream(entry.replaced)
            entry.replaced.replace_all_uses_with(piece)
            graph.erase_node(entry.replaced)
            for node in downstream:  # the division by dp_size, now after the slice it divides
                before.prepend(node)


def _downstream(node: fx.Node) -> list[fx.Node]:
    """Nodes computed from `node` on the way to the output, in graph order."""
    seen, stack = set(), list(node.users)
    while stack:
        user = stack.pop()
        if user.op != "output" and user not in seen:
            seen.add(user)
            stack.extend(user.users)
    return [n for n in node.graph.nodes if n in seen]


def _contiguous(graph: fx.Graph, node: fx.Node) -> fx.Node:
    if fake_value(node).is_contiguous():
        return node
    return graph_call(graph, aten.clone.default, node, memory_format=torch.contiguous_format)
