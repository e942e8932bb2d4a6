"""Pass 1, sequence parallelism: the walk (`walk`) over Dynamo's Torch-IR graph of one rank that finds attention and
the sequence inputs (`analysis`), narrows full values to this rank's shard (`shard`, `indices`, `index_chains`),
resizes views (`resize`), pads any length (`padding`), keeps MoE routing local (`routing`, `expert_counts`), slices
dropout masks (`dropout`), reduces the loss over the group (`loss`), routes attention through
`attention/` (all-to-alls, the hybrid with ring attention, hand-written and flex attention, masks in O(S)) and causal
convolutions, the gated delta rule, Mamba's scans and lightning attention through `recurrence/` (their kernel markers:
`trace_gated_delta_rules`, `trace_ssd_scans`, `trace_selective_scans`, `trace_lightning_attention`, which the tracing
installs; `tile_recurrences`, the recurrences over tiles of a rank's tokens, which the tiling pass runs). The
names below are what the rest of the compiler (and the project Llama, for its masked attention) imports; the modules
are private to this package."""
from __future__ import annotations

from autosp.compiler.sp.attention.flex import check_flex_lowering
from autosp.compiler.sp.attention.hybrid import subgroups
from autosp.compiler.sp.attention.masked_attention import masked_attention
from autosp.compiler.sp.recurrence.delta_rule_op import trace_gated_delta_rules
from autosp.compiler.sp.recurrence.lightning_op import trace_lightning_attention
from autosp.compiler.sp.recurrence.selective_scan_op import trace_selective_scans
from autosp.compiler.sp.recurrence.ssd_op import trace_ssd_scans
from autosp.compiler.sp.recurrence.tiles import tile_recurrences
from autosp.compiler.sp.walk import sequence_parallel_pass

__all__ = ["check_flex_lowering", "masked_attention", "sequence_parallel_pass", "subgroups", "tile_recurrences",
           "trace_gated_delta_rules", "trace_lightning_attention", "trace_selective_scans", "trace_ssd_scans"]
