"""The torch.compile backend: Dynamo graph -> SP pass -> aot_autograd (SAC partitioner) -> inductor.

The SP pass works on Dynamo's Torch-IR graph, where `scaled_dot_product_attention`, `view(B, S, ...)` and the
loss are still visible. aot_autograd then traces forward and backward jointly; the partition function decides
what forward values backward keeps (sequence-aware checkpointing) before inductor compiles both halves.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from autosp.comm.grad_sync import GradientReduction, ReducingPartitioner, sync_gradients
from autosp.compiler.hybrid import subgroups
from autosp.compiler.offload import OffloadingPartitioner, parse_offload
from autosp.compiler.sac import compile_with_partitioner, make_partition_fn
from autosp.compiler.sp_pass import sequence_parallel_pass
from autosp.compiler.specialize import is_symbolic, per_length
from autosp.compiler.tiling import apply_tiling, check_outputs, parse_tiling
from autosp.errors import SequenceParallelError

INNER_BACKENDS = ("inductor", "aot_eager", "eager")


def make_backend(
    sp_group: dist.ProcessGroup, *, reduce_group: dist.ProcessGroup | None = None, dp_size: int = 1,
    sac: str = "sac", inner: str = "inductor", zero: int = 0, tiling: str = "off", outputs: str = "all",
    ulysses_size: int | None = None, offload: str = "off",
) -> Callable[[fx.GraphModule, list[Any]], Callable]:
    """A torch.compile backend making the graph sequence parallel over `sp_group`.

    `reduce_group` (default: `sp_group`) holds every rank that shares the parameters (SP x DP); their gradients
    are summed over it and divided by `dp_size` inside the backward graph, one collective per bucket of gradients
    (`autosp.comm.grad_sync`): all-reduced at ZeRO stages 0/1, reduce-scattered at stages 2/3 (the parameters are
    shards, `autosp.comm.sharding`).
    `ulysses_size`: see `hybrid` (default: chosen from the heads).
    `offload`: off | activations — the layer-boundary values backward keeps wait in host memory
    (`autosp.compiler.offload`)."""
    if inner not in INNER_BACKENDS:
        raise SequenceParallelError(f"unknown inner backend {inner!r}; choose one of {', '.join(INNER_BACKENDS)}")
    # cacheable=False: aot_autograd re-partitions (inductor still reuses its compiled kernels), so the records of
    # what every graph saves exist on each run, not only on a cold cache
    partition_fn = make_partition_fn(sac, cacheable=False)  # also validates the policy before any compilation
    tiling_options, outputs = parse_tiling(tiling), check_outputs(outputs)
    tiling_reports: list = []
    offloads = parse_offload(offload)
    if offloads and inner == "eager":
        raise SequenceParallelError("offload=activations rewrites the partitioned forward/backward graphs; "
                                    "use backend aot_eager or inductor, not eager")
    offloading: list[OffloadingPartitioner] = []
    sp_rank, sp_size = dist.get_rank(sp_group), dist.get_world_size(sp_group)
    group = reduce_group or sp_group
    reduction = GradientReduction(group.group_name, dist.get_world_size(group), dp_size, sharded=zero >= 2) \
        if dist.get_world_size(group) > 1 else None
    partitioners: list[ReducingPartitioner] = []

    def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        if inner == "eager" and zero < 2 and reduction is not None:  # no joint graph to put the buckets into
            sync_gradients((t for t in example_inputs if isinstance(t, torch.nn.Parameter)), group, dp_size)
        if is_symbolic(example_inputs):
            return per_length(gm, compile_static)
        return compile_static(gm, example_inputs)

    def compile_static(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        if sp_size > 1:  # an SP degree of 1 is single-device training: only the checkpointing policy applies
            gm = sequence_parallel_pass(gm, sp_rank=sp_rank, sp_size=sp_size, group_name=sp_group.group_name,
                                        ulysses_size=ulysses_size, hybrid_groups=hybrid_group_names)
        tiling_reports.append(apply_tiling(gm, tiling_options, loss_only=outputs == "loss"))
        if inner == "eager":  # autograd runs through the custom ops' formulas; nothing is partitioned
            return gm.forward
        partition = partition_fn
        if reduction is not None:
            params = [i for i, t in enumerate(example_inputs)
                      if isinstance(t, torch.nn.Parameter) and t.requires_grad]
            partitioners.append(ReducingPartitioner(partition_fn, reduction, params))
            partition = partitioners[-1]
        if offloads:
            offloading.append(OffloadingPartitioner(partition))
            partition = offloading[-1]
        return compile_with_partitioner(gm, example_inputs, partition_fn=partition, inner=inner)

    def hybrid_group_names(ulysses: int) -> tuple[str, str]:
        return tuple(g.group_name for g in subgroups(sp_group, ulysses))

    compile_graph.partition_fn = partition_fn  # its .records tell what each compiled graph saves for backward
    compile_graph.tiling_reports = tiling_reports  # what each compiled graph tiled, and why not the rest
    compile_graph.offload_partitioners = offloading  # .reports: each graph's offloaded values and bytes
    compile_graph.gradient_partitioners = partitioners  # .buckets: each graph's gradient collectives
    return compile_graph
