"""The compiler's pipeline, as data: the ordered passes every graph goes through, each a named function with a
one-line contract (what it requires, what it guarantees), run in this order by `compile_static` and `Partitioner`.

  graph passes        on Dynamo's Torch-IR graph of one rank (static shapes), before aot_autograd:
    sequence_parallel   the SP rewrite (analysis, causal masks, the walk of `sp.walk`, structured masks)
    tiling              LM head + loss (and token-wise blocks) over tiles of the local tokens
  joint passes        on aot_autograd's joint forward+backward graph, before it is partitioned:
    gradient_buckets    gradient collectives in buckets inside backward
  partition           SAC/planner tags + torch's min-cut partitioner (`autosp.compiler.memory`): forward, backward
  partitioned passes  on the partitioned forward and backward graphs:
    gather_prefetch     ZeRO 2/3 parameter gathers bucketed per layer, issued one layer ahead
    offload             layer-boundary values kept in host memory between forward and backward
  lowering            Inductor or aot_eager compiles both graphs (`autosp.compiler.lowering`)

`AUTOSP_DUMP_GRAPHS=<dir>` writes every graph before and after every pass (and the partition) as readable
text, one file each: `<graph>-<step>-<pass>-<before|after>[-forward|-backward].txt`, numbered in run order.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

from autosp.compiler import memory, zero
from autosp.compiler.fx import copy_graph
from autosp.compiler.lowering import compile_with_partitioner
from autosp.compiler.memory import (
    KeepLargerTiles,
    OffloadReport,
    SacPartitioner,
    TileFirst,
    TileSmaller,
    make_partition_fn,
    offload_boundaries,
    reserve_host_buffers,
)
from autosp.compiler.options import CompileOptions
from autosp.compiler.sp import check_flex_lowering, sequence_parallel_pass, tile_recurrences
from autosp.compiler.tiling import Tiling, TilingReport, apply_tiling
from autosp.compiler.zero import Bucket, GatherBucket, GradientReduction, bucket_gradient_reduction, prefetch_gathers

DUMP_ENV = "AUTOSP_DUMP_GRAPHS"


@dataclass(frozen=True)
class Pass:
    """One step of the pipeline: `run` and its contract (`requires` -> `guarantees`)."""

    name: str
    run: Callable[..., Any]
    requires: str
    guarantees: str


@dataclass
class GraphRecord:
    """What the partition-time passes did to one compiled graph."""

    param_positions: tuple[int, ...] = ()
    buckets: list[Bucket] = field(default_factory=list)
    gather_buckets: tuple[list[GatherBucket], list[GatherBucket]] = ([], [])  # (forward, backward)
    offload_reports: list[OffloadReport] = field(default_factory=list)


@dataclass
class Compilation:
    """One backend's options, groups and the records its passes leave (read by `SequenceParallelModule`)."""

    options: CompileOptions
    sp_rank: int = 0
    sp_size: int = 1
    group_name: str = ""
    reduction: GradientReduction | None = None
    hybrid_groups: Callable[[int], tuple[str, str]] | None = None
    partition_fn: SacPartitioner = None  # type: ignore[assignment]
    tiling_reports: list[TilingReport] = field(default_factory=list)
    graphs: list[GraphRecord] = field(default_factory=list)
    #: what the tiling pass tiles in the graph being compiled: the option, or under `tiling="plan"` nothing first
    #: and `Tiling.when_tight` where the planner finds it does not fit untiled (`compile_static`)
    graph_tiling: Tiling = field(default_factory=Tiling)

    def __post_init__(self) -> None:
        if self.partition_fn is None:
            # cacheable=False: aot_autograd re-partitions (inductor still reuses its compiled kernels), so the
            # records of what every graph saves exist on each run, not only on a cold cache
            self.partition_fn = make_partition_fn(self.options.policy, cacheable=False,
                                                  offload=self.options.offload_mode,
                                                  host_budget=self.options.host_budget)


# ------------------------------------------------------------------------------------------- graph passes


def sequence_parallel(c: Compilation, gm: fx.GraphModule) -> fx.GraphModule:
    if c.sp_size > 1:  # an SP degree of 1 is single-device training: only the checkpointing policy applies
        gm = sequence_parallel_pass(gm, sp_rank=c.sp_rank, sp_size=c.sp_size, group_name=c.group_name,
                                    ulysses_size=c.options.ulysses_size, hybrid_groups=c.hybrid_groups,
                                    attention_chunks=c.options.attention_chunks)
    return gm


def tiling(c: Compilation, gm: fx.GraphModule) -> fx.GraphModule:
    report = apply_tiling(gm, c.graph_tiling, loss_only=c.options.outputs == "loss")
    if c.graph_tiling.recurrence:
        report.recurrences = tile_recurrences(gm, c.graph_tiling.tile_tokens)
    c.tiling_reports.append(report)
    return gm


GRAPH_PASSES: tuple[Pass, ...] = (
    Pass("sequence_parallel", sequence_parallel,
         "one rank's Dynamo graph of single-device code, static shapes",
         "it computes single-device training on this rank's sequence shard (autosp_sp:: collectives; none at SP 1)"),
    Pass("tiling", tiling,
         "a Dynamo graph (after the SP rewrite: local tokens)",
         "each tileable LM head + loss (and token-wise block, per the option) runs over tiles, exact; a report"),
)

# ------------------------------------------------------------------------------------------- joint passes


def gradient_buckets(c: Compilation, record: GraphRecord, joint_gm: fx.GraphModule, num_fwd_outputs: int) -> None:
    if c.reduction is not None:
        record.buckets = bucket_gradient_reduction(joint_gm, num_fwd_outputs=num_fwd_outputs,
                                                   param_positions=record.param_positions, reduction=c.reduction)


JOINT_PASSES: tuple[Pass, ...] = (
    Pass("gradient_buckets", gradient_buckets,
         "the joint graph; the parameters' positions among its inputs",
         "parameter gradients leave backward reduced over the ranks sharing them, one collective per bucket"),
)

# ------------------------------------------------------------------------------------- partitioned passes


def gather_prefetch(c: Compilation, record: GraphRecord, fw: fx.GraphModule, bw: fx.GraphModule,
                    num_fwd_outputs: int) -> None:
    if c.reduction is not None and c.reduction.sharded:  # the stage-3 re-gathers are in the backward graph by now
        record.gather_buckets = (prefetch_gathers(fw), prefetch_gathers(bw))


def offload_activations(c: Compilation, record: GraphRecord, fw: fx.GraphModule, bw: fx.GraphModule,
                        num_fwd_outputs: int) -> None:
    if c.partition_fn.plans_offload:  # the planner decided (and rewrote the graphs) while partitioning
        planned = c.partition_fn.records[-1].offload
        if planned is not None:
            record.offload_reports.append(planned)
    elif c.options.offloads:
        record.offload_reports.append(offload_boundaries(fw, bw, num_fwd_outputs))
    reserve_host_buffers(fw)  # the pinned pool sized by what this plan moves, allocated at the first step


PARTITIONED_PASSES: tuple[Pass, ...] = (
    Pass("gather_prefetch", gather_prefetch,
         "partitioned graphs with one autosp_sp::all_gather_shard per parameter use (ZeRO 2/3)",
         "each layer's gathers are one asynchronous all-gather, issued during the previous layer"),
    Pass("offload", offload_activations,
         "partitioned graphs; what forward saves for backward decided (under sac auto: also what it offloads)",
         "saved layer-boundary values wait in host memory between forward and backward; a report"),
)

# ------------------------------------------------------------------------------------------------ running


class _Dump:
    """Writes graphs to `AUTOSP_DUMP_GRAPHS` (nothing when it is unset), numbered in run order."""

    _graphs = itertools.count()

    def __init__(self) -> None:
        directory = os.environ.get(DUMP_ENV)
        self.dir = Path(directory) if directory else None
        self.graph = next(self._graphs) if self.dir else 0
        self.step = 0

    def __call__(self, name: str, when: str, graphs: Sequence[tuple[str, fx.GraphModule]]) -> None:
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for suffix, gm in graphs:
            path = self.dir / f"{self.graph:03d}-{self.step:02d}-{name}-{when}{suffix}.txt"
            path.write_text(gm.print_readable(print_output=False, include_stride=True, include_device=True))
        if when == "after":
            self.step += 1


def _sources(*stages: ModuleType) -> tuple[str, ...]:
    """Every source file of these stages' packages: what the passes a `Partitioner` runs are made of."""
    return tuple(str(path) for stage in stages for path in sorted(Path(stage.__file__).parent.rglob("*.py")))


class Partitioner(CustomPartitionerFn):
    """aot_autograd's partition function for one graph: `JOINT_PASSES`, the SAC partition, `PARTITIONED_PASSES`."""

    def __init__(self, c: Compilation, record: GraphRecord, dump: _Dump | None = None, *,
                 tile_first: bool = False, smaller_tiles_below: int | None = None,
                 larger_tiles_peak: int | None = None, last_rung_first: bool = False,
                 no_rung_fits: bool = False) -> None:
        self.c, self.record, self.dump = c, record, dump or _Dump()
        self.cacheable = c.partition_fn.cacheable
        self.tile_first = tile_first  # `tiling="plan"`'s untiled try: the planner raises TileFirst where it is tight
        self.smaller_tiles_below = smaller_tiles_below  # its tiled tries: TileSmaller where no rung fits
        self.larger_tiles_peak = larger_tiles_peak  # a halving's try: KeepLargerTiles where it peaks no lower
        self.last_rung_first = last_rung_first  # a retry with halved tiles: the last rung tried first
        self.no_rung_fits = no_rung_fits  # the larger tiles again (KeepLargerTiles): their last rung, partitioned alone

    def __call__(self, joint_gm: fx.GraphModule, joint_inputs: Sequence[object], *, num_fwd_outputs: int,
                 **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        for step in JOINT_PASSES:
            self.dump(step.name, "before", [("", joint_gm)])
            step.run(self.c, self.record, joint_gm, num_fwd_outputs)
            self.dump(step.name, "after", [("", joint_gm)])
        self.dump("partition", "before", [("", joint_gm)])
        if self.tile_first:
            kwargs["tile_first"] = True
        if self.smaller_tiles_below is not None:
            kwargs["smaller_tiles_below"] = self.smaller_tiles_below
        if self.larger_tiles_peak is not None:
            kwargs["larger_tiles_peak"] = self.larger_tiles_peak
        if self.last_rung_first:
            kwargs["last_rung_first"] = True
        if self.no_rung_fits:
            kwargs["no_rung_fits"] = True
        fw, bw = self.c.partition_fn(joint_gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        self.dump("partition", "after", [("-forward", fw), ("-backward", bw)])
        for step in PARTITIONED_PASSES:
            self.dump(step.name, "before", [("-forward", fw), ("-backward", bw)])
            step.run(self.c, self.record, fw, bw, num_fwd_outputs)
            self.dump(step.name, "after", [("-forward", fw), ("-backward", bw)])
        return fw, bw

    def __deepcopy__(self, memo: dict) -> Partitioner:
        """Shared, not copied: Inductor deep-copies its config, partitioner included, for a repro string, and the
        records this partitioner fills are the backend's (as `PartitionRecord.__deepcopy__`)."""
        return self

    def uuid(self) -> Any:
        return (self.c.partition_fn.uuid(), repr(self.c.reduction), self.record.param_positions,
                self.c.options.offload_mode, self.tile_first, self.smaller_tiles_below, self.larger_tiles_peak,
                self.last_rung_first, self.no_rung_fits,
                get_hash_for_files((__file__, *_sources(zero, memory))))


def compile_static(c: Compilation, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """One static Dynamo graph through the pipeline: `GRAPH_PASSES`, then (unless the backend is eager) lowered
    with `Partitioner` as aot_autograd's partition function (refused first where the backend cannot lower it:
    `check_flex_lowering`). Under `tiling="plan"` with the planner the graph is lowered untiled first; where the
    planner finds it does not fit so (`TileFirst`), the tiling pass runs as `Tiling.when_tight` on the graph as it
    was before it, and that is lowered instead (`_lower_tiled`; its records only)."""
    check_flex_lowering(gm, c.options.backend)
    option = c.options.tiling_options
    planned = option.planned and c.partition_fn.plans_offload and c.options.backend != "eager"
    c.graph_tiling = Tiling() if option.planned else option
    dump = _Dump()
    untiled = None
    for step in GRAPH_PASSES:
        if step.name == "tiling" and planned:
            untiled = copy_graph(gm)
        dump(step.name, "before", [("", gm)])
        gm = step.run(c, gm)
        dump(step.name, "after", [("", gm)])
    if c.options.backend == "eager":  # autograd runs through the custom ops' formulas; nothing is partitioned
        return gm.forward
    if untiled is None:
        return _lower(c, gm, example_inputs, dump)
    try:
        return _lower(c, gm, example_inputs, dump, tile_first=True)
    except TileFirst:
        c.graphs.pop()
        c.tiling_reports.pop()
    return _lower_tiled(c, untiled, example_inputs, dump)


def _lower_tiled(c: Compilation, untiled: fx.GraphModule, example_inputs: list[Any], dump: _Dump) -> Callable:
    """`untiled` tiled as `Tiling.when_tight` and lowered; where no rung of the planner fits even so (`TileSmaller`:
    a recomputed layer's backward binds, its token-wise blocks' tile-sized intermediates among its working set),
    tiled again with the blocks' tiles halved (`Tiling.mlp_halvings`) while the tiles stay above the floor
    (`TilingReport.halvable`). A halving is kept only where it lowers the planner's estimated peak: where it does
    not (`KeepLargerTiles`), the previous tiles are lowered again with the plan their try found, the last rung
    (`plan_partition(no_rung_fits=True)`: one partition, not the ladder). Each retry partitions the planner's
    last rung first (`plan_partition(last_rung_first=True)`). A graph that fits with the `when_tight` tiles is
    lowered once, unchanged. The plan records the halvings (`mlp_tile_halvings`)."""
    below, halvings, halve = sys.maxsize, 0, True
    while True:
        c.graph_tiling = dataclasses.replace(c.options.tiling_options.when_tight(), mlp_halvings=halvings)
        gm = copy_graph(untiled)
        dump("tiling", "before", [("", gm)])
        gm = tiling(c, gm)
        dump("tiling", "after", [("", gm)])
        try:
            compiled = _lower(c, gm, example_inputs, dump,
                              smaller_tiles_below=below if halve and c.tiling_reports[-1].halvable else None,
                              larger_tiles_peak=below if halve and halvings else None,
                              last_rung_first=halvings > 0, no_rung_fits=not halve)
        except (TileSmaller, KeepLargerTiles) as tight:
            c.graphs.pop()
            c.tiling_reports.pop()
            if isinstance(tight, TileSmaller):
                below, halvings = tight.peak, halvings + 1
            else:
                halvings, halve = halvings - 1, False
            continue
        if halvings:
            c.partition_fn.records[-1].plan["mlp_tile_halvings"] = halvings
        return compiled


def _lower(c: Compilation, gm: fx.GraphModule, example_inputs: list[Any], dump: _Dump, *,
           tile_first: bool = False, smaller_tiles_below: int | None = None,
           larger_tiles_peak: int | None = None, last_rung_first: bool = False,
           no_rung_fits: bool = False) -> Callable:
    """aot_autograd and the backend's compiler over `gm`, `Partitioner` deciding the joint graph's split."""
    positions = tuple(i for i, t in enumerate(example_inputs) if isinstance(t, torch.nn.Parameter) and t.requires_grad)
    record = GraphRecord(param_positions=positions if c.reduction is not None else ())
    c.graphs.append(record)
    return compile_with_partitioner(gm, example_inputs, partition_fn=Partitioner(
        c, record, dump, tile_first=tile_first, smaller_tiles_below=smaller_tiles_below,
        larger_tiles_peak=larger_tiles_peak, last_rung_first=last_rung_first, no_rung_fits=no_rung_fits),
                                    inner=c.options.backend)


def reduction_over(group: dist.ProcessGroup, dp_size: int, zero: int) -> GradientReduction | None:
    """How gradients are reduced over `group` (every rank sharing the parameters); None for a group of one."""
    size = dist.get_world_size(group)
    return GradientReduction(group.group_name, size, dp_size, sharded=zero >= 2) if size > 1 else None
