"""Sequence-aware activation checkpointing (SAC): a partition function for aot_autograd.

At long sequence lengths attention dominates the FLOPs while linear/MLP work grows only linearly in S, so the
cheap way to free activation memory is to keep attention's results and recompute everything else of a decoder
layer in backward. This module steers torch's own min-cut partitioner by tagging joint-graph nodes with
``node.meta["recompute"]`` (a ``CheckpointPolicy``); it patches nothing process-wide.

Policies (``parse_policy``):
  off            the stock min-cut partitioner (collectives pinned, as everywhere);
  sac            attention ops and their outputs (out, logsumexp) MUST_SAVE, collectives MUST_SAVE (never
                 re-run), each decoder layer's outputs MUST_SAVE (so backward rebuilds one layer at a time),
                 every other forward op inside a layer PREFER_RECOMPUTE; ops outside the layers (embedding,
                 final norm, head, loss) are left to the min-cut;
  budget=<f>     attention and collectives pinned, then torch's ``activation_memory_budget`` = f;
  full           per-layer full checkpointing: only layer outputs and collectives saved, attention included
                 in the recomputation;
  auto           the memory planner (`planner`), the compiler's default: per layer, the cheapest mix
                 of keeping, moving layer boundaries to host memory and the above recomputation whose estimated
                 peak fits a per-rank byte budget (``budget=<bytes>``, e.g. ``budget=32MiB``; plain ``auto``:
                 the device's free memory at compile time, no limit on CPU) — nothing recomputed or moved when all
                 fits.

Layers are found from Dynamo's ``nn_module_stack`` (the first ``<name>.<int>`` / ``<name>[<int>]`` in a module
path, e.g. ``model.layers.3``); nodes without one (inserted by the SP pass) inherit their inputs' layer.

Note on this torch's partitioner: a node tagged PREFER_RECOMPUTE is *forced* into backward (an infinite edge to
the sink), exactly like MUST_RECOMPUTE, and a MUST_SAVE tag bans recomputation. Hence the layer outputs must be
pinned: without them every layer's recomputation would start from the embedding and all of it would be alive
at the start of backward.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

from autosp.compiler.memory.policy import Policy, SacPolicy, parse_policy
from autosp.compiler.memory.records import PartitionRecord
from autosp.compiler.memory.tags import tag_joint_graph

#: the modules whose source decides a partition: Inductor's caches are keyed by their contents (`SacPartitioner.uuid`)
PARTITION_SOURCES = ("autosp.compiler.memory.partitioner", "autosp.compiler.memory.planner",
                     "autosp.compiler.memory.rungs", "autosp.compiler.memory.time_rank", "autosp.compiler.memory.flops",
                     "autosp.compiler.memory.tags", "autosp.compiler.memory.offload", "autosp.compiler.fx.node_kinds",
                     "autosp.compiler.fx.layers")


class SacPartitioner(CustomPartitionerFn):
    """Callable partition function for aot_autograd; also a valid ``torch._inductor.config
    .custom_partitioner_fn`` (its uuid keys Inductor's caches by policy and this file's source).

    ``records`` collects one PartitionRecord per joint graph partitioned. Under Inductor a warm AOTAutograd
    cache skips partitioning (no record); ``cacheable=False`` makes ``compile_with_partitioner`` bypass that
    cache so the records are always there."""

    def __init__(self, policy: Policy, *, cacheable: bool = True, offload: str = "auto",
                 host_budget: int | None = None) -> None:
        self.policy = policy
        self.cacheable = cacheable
        self.offload, self.host_budget = offload, host_budget  # the planner's (policy auto) host-memory lever
        self.records: list[PartitionRecord] = []

    @property
    def plans_offload(self) -> bool:
        """Whether this partition function decides the offload (policy auto), not the pipeline's offload pass."""
        return self.policy.kind == SacPolicy.AUTO

    def __call__(
        self, joint_gm: fx.GraphModule, joint_inputs: Sequence[object], *, num_fwd_outputs: int,
        tile_first: bool = False, smaller_tiles_below: int | None = None, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Partition `joint_gm`; `tile_first` (policy auto, `tiling="plan"`): the planner raises
        `planner.TileFirst` where the graph does not fit untiled with everything kept; `smaller_tiles_below` (a
        tiled graph): `planner.TileSmaller` where no rung fits and the peak is below it."""
        if self.policy.kind == SacPolicy.AUTO:
            from autosp.compiler.memory.planner import plan_partition

            fw_module, bw_module, plan, offloaded = plan_partition(
                joint_gm, joint_inputs, self.policy.budget_bytes, num_fwd_outputs=num_fwd_outputs,
                offload=self.offload, host_budget_bytes=self.host_budget, tile_first=tile_first,
                smaller_tiles_below=smaller_tiles_below, **kwargs
            )
            self.records.append(PartitionRecord(str(self.policy), fw_module, bw_module, num_fwd_outputs, plan,
                                                offload=offloaded))
            return fw_module, bw_module
        tag_joint_graph(joint_gm, self.policy)
        budget = (
            functorch_config.patch(activation_memory_budget=self.policy.budget)
            if self.policy.kind == SacPolicy.BUDGET
            else nullcontext()
        )
        with budget:
            fw_module, bw_module = min_cut_rematerialization_partition(
                joint_gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
            )
        self.records.append(PartitionRecord(str(self.policy), fw_module, bw_module, num_fwd_outputs))
        return fw_module, bw_module

    def uuid(self) -> Any:
        # Never None: Inductor would then key the artifact like the stock partitioner's.
        return (str(self.policy), self.offload, self.host_budget,
                get_hash_for_files(tuple(importlib.util.find_spec(module).origin for module in PARTITION_SOURCES)))


def make_partition_fn(policy: str | Policy = SacPolicy.SAC, *, cacheable: bool = True, offload: str = "auto",
                      host_budget: int | None = None) -> SacPartitioner:
    """Partition function for ``aot_autograd(..., partition_fn=...)`` implementing ``policy`` (under ``auto`` also
    the host-memory lever: ``offload`` and ``host_budget``, `autosp.compiler.memory.planner.plan_partition`)."""
    return SacPartitioner(parse_policy(policy), cacheable=cacheable, offload=offload, host_budget=host_budget)
