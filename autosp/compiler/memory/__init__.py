"""Passes 4 and 6, memory: what backward keeps, recomputes or finds in host memory. The checkpointing policies
(`policy`) as tags on the joint graph (`tags`), the partition function (`partitioner`: tags + torch's min-cut, or the
memory planner, `planner`, under policy auto; the FLOPs it prices recompute by, `flops`), what a partition saved
(`records`) and its breakdown by category (`saved_report`), the offload pass and its ops (`offload`), the planner's
ranking by predicted time (`time_rank`), its signals to the driver about tiling (`retile`).
The names below are what the driver, the harness and the baselines import; the modules are private to this
package.

The partition function loads on first use (PEP 562): it imports torch's partitioner and Inductor, seconds that a
rank of an eager method, or the harness reading a policy or an offload option, does not pay."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autosp.compiler.memory.offload import (
    DEVICE_WINDOW,
    OFFLOAD_OP,
    OFFLOAD_OP_NAME,
    OffloadPlan,
    OffloadReport,
    check_params_offload,
    offload_boundaries,
    reserve_host_buffers,
)
from autosp.compiler.memory.policy import POLICY_CHOICES, Policy, SacPolicy, parse_policy
from autosp.compiler.memory.records import PartitionRecord
from autosp.compiler.memory.retile import KeepLargerTiles, TileFirst, TileSmaller
from autosp.compiler.memory.saved_report import (
    CATEGORIES,
    UNATTRIBUTED,
    category_of_module,
    compiled_breakdown,
    peak_working_set,
    quadratic_saved_values,
    tiles_of,
)
from autosp.compiler.memory.time_rank import planning_rates

if TYPE_CHECKING:
    from autosp.compiler.memory.partitioner import SacPartitioner, make_partition_fn

__all__ = ["CATEGORIES", "DEVICE_WINDOW", "OFFLOAD_OP", "OFFLOAD_OP_NAME", "POLICY_CHOICES", "UNATTRIBUTED",
           "OffloadPlan", "OffloadReport", "PartitionRecord", "Policy", "SacPartitioner", "SacPolicy", "TileFirst",
           "KeepLargerTiles", "TileSmaller",
           "category_of_module", "check_params_offload", "compiled_breakdown", "make_partition_fn",
           "offload_boundaries", "parse_policy", "peak_working_set", "planning_rates",
           "quadratic_saved_values", "reserve_host_buffers", "tiles_of"]

_ON_FIRST_USE = ("SacPartitioner", "make_partition_fn")


def __getattr__(name: str) -> Any:
    if name in _ON_FIRST_USE:
        from autosp.compiler.memory import partitioner

        return getattr(partitioner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
