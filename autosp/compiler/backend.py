"""The torch.compile backend: Dynamo graph -> the pipeline's passes (`autosp.compiler.pipeline`) -> lowering.

The SP pass works on Dynamo's Torch-IR graph, where `scaled_dot_product_attention`, `view(B, S, ...)` and the
loss are still visible. aot_autograd then traces forward and backward jointly; the pipeline's partition function
decides what forward values backward keeps (sequence-aware checkpointing) before inductor compiles both halves.
This module only binds a pipeline to the process groups and to Dynamo's calls (one static graph per length).

What must hold while Dynamo traces (logging calls left out of the graph, HF's output hooks installed beforehand,
`autosp.compiler.tracing`) is set up here too, for a plain `torch.compile(model, backend=autosp.backend(model=m))`:
the output hooks when the backend is given the model, the tracing settings as the backend's `backend_ctx_ctor`
(which Dynamo enters around every call). That context alone did not keep a model's logging call out of the graph
(tests/compiler/test_coverage.py, the soft-capped attention), so the `autosp.compile` wrapper enters the settings
itself as well. Dynamo's own tracing errors (graph breaks, sizes read from tensor values) are raised at the call
before any backend runs, so only that wrapper can turn them into one line.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from autosp.comm.grad_sync import sync_gradients
from autosp.compiler.sp.attention.hybrid import subgroups
from autosp.compiler.options import CompileOptions
from autosp.compiler.pipeline import Compilation, compile_static, reduction_over
from autosp.compiler.specialize import is_symbolic, per_length
from autosp.compiler.tracing import install_output_hooks, tracing_config


def make_backend(
    sp_group: dist.ProcessGroup, options: CompileOptions | None = None, *,
    reduce_group: dist.ProcessGroup | None = None, dp_size: int = 1, zero: int = 0, model: torch.nn.Module | None = None,
) -> Callable[[fx.GraphModule, list[Any]], Callable]:
    """A torch.compile backend making the graph sequence parallel over `sp_group`, as `options` say
    (`autosp.compiler.options`; default: the defaults).

    `reduce_group` (default: `sp_group`) holds every rank that shares the parameters (SP x DP); their gradients
    are summed over it and divided by `dp_size` inside the backward graph, one collective per bucket of gradients
    (`autosp.compiler.zero.grad_buckets`): all-reduced at ZeRO stages 0/1, reduce-scattered at stages 2/3 (the
    parameters are shards, `autosp.comm.sharding`). `zero` is the stage that runs (resolved by the caller).
    `model`, when given, gets HF's output-capturing hooks now (`tracing.install_output_hooks`: without them an HF
    model asked for router logits or hidden states breaks the graph).
    The backend's `compilation` holds what the passes report (`autosp.compiler.pipeline.Compilation`)."""
    if model is not None:
        install_output_hooks(model)
    options = options if options is not None else CompileOptions()
    group = reduce_group or sp_group

    def hybrid_group_names(ulysses: int) -> tuple[str, str]:
        return tuple(g.group_name for g in subgroups(sp_group, ulysses))

    compilation = Compilation(options, sp_rank=dist.get_rank(sp_group), sp_size=dist.get_world_size(sp_group),
                              group_name=sp_group.group_name, reduction=reduction_over(group, dp_size, zero),
                              hybrid_groups=hybrid_group_names)

    def static(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        return compile_static(compilation, gm, example_inputs)

    def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        if options.backend == "eager" and zero < 2 and compilation.reduction is not None:  # no joint graph
            sync_gradients((t for t in example_inputs if isinstance(t, torch.nn.Parameter)), group, dp_size)
        if is_symbolic(example_inputs):
            return per_length(gm, static)
        return static(gm, example_inputs)

    compile_graph.__name__ = "autosp"  # Dynamo names the backend that raised by it
    compile_graph.backend_ctx_ctor = tracing_config  # entered by Dynamo around every call, tracing included
    compile_graph.compilation = compilation
    compile_graph.partition_fn = compilation.partition_fn  # its .records tell what each compiled graph saves
    return compile_graph
