"""Graph helpers every stage uses (the lowest stage: it imports no other): new FX nodes with their fake values and a
node's bytes (`nodes`), what a node is (`node_kinds`), its place in the model and its decoder layer (`layers`), SDPA
calls and their arguments (`sdpa`), byte sizes as users write them (`sizes`). The names below are what the other
stages import; the modules are private to this package."""
from __future__ import annotations

from autosp.compiler.fx.layers import (
    assign_layers,
    forward_nodes,
    global_callee,
    layer_of_path,
    model_module,
    module_path,
    user_path,
)
from autosp.compiler.fx.node_kinds import (
    AUTOSP_ATTENTION_OPS,
    AUTOSP_COLLECTIVE_OPS,
    AUTOSP_HOST_PARAM_OPS,
    AUTOSP_OFFLOAD_OPS,
    AUTOSP_OPAQUE_OPS,
    AUTOSP_TOKENWISE_OPS,
    getitem_source,
    holds_tensors,
    is_attention_forward,
    is_attention_value,
    is_collective,
    is_collective_value,
    is_mutating,
    is_opaque,
    is_pinned_value,
    is_random,
    is_view,
    unwrap_rng,
)
from autosp.compiler.fx.nodes import (
    DYNAMO,
    VMAP_LEVELS,
    copy_graph,
    dynamo_value,
    eliminate_dead_code,
    emit,
    fake_value,
    graph_call,
    node_nbytes,
    run_fake,
)
from autosp.compiler.fx.sdpa import SDPA_PARAMS, attention_args, is_attention
from autosp.compiler.fx.sizes import UNITS, parse_size, split_size

__all__ = ["AUTOSP_ATTENTION_OPS", "AUTOSP_COLLECTIVE_OPS", "AUTOSP_HOST_PARAM_OPS", "AUTOSP_OFFLOAD_OPS",
           "AUTOSP_OPAQUE_OPS", "AUTOSP_TOKENWISE_OPS", "DYNAMO", "SDPA_PARAMS", "UNITS", "VMAP_LEVELS",
           "assign_layers", "attention_args", "copy_graph", "dynamo_value", "eliminate_dead_code", "emit", "fake_value",
           "forward_nodes", "getitem_source", "global_callee", "graph_call", "holds_tensors", "is_attention",
           "is_attention_forward", "is_attention_value", "is_collective", "is_collective_value", "is_mutating",
           "is_opaque", "is_pinned_value", "is_random", "is_view", "layer_of_path", "model_module", "module_path",
           "node_nbytes", "parse_size", "run_fake", "split_size", "unwrap_rng", "user_path"]
