"""DeepSpeed's AutoSP backend, run per length on one Dynamo trace (a search's shared ds-autosp rank program).

DeepSpeed marks the sequence dimension dynamic (`prepare_autosp_inputs`), so Dynamo traces the model with a
symbolic length `s`. Its AutoSP pass then specialises the shard length: its shape propagation runs `pad` on
the sharded labels, whose kernel reads their concrete size, adding the guard `s // P == L / P` to Dynamo's
shape environment. So a real run retraces the model at every new length, and a search's shared program paid
a Dynamo trace per length (about a fifth of each probe's compile) and hit Dynamo's recompile limit.

Dynamo's graph does not depend on the length (its own guards on `s`, still checked on every call, hold at
every length a probe runs), so `per_length(backend)` keeps that one symbolic graph and, at each new length,
hands DeepSpeed's own backend (its AutoSP pass, then its `torch._inductor.compile`) what Dynamo would have
handed it had it traced at that length: a copy of the graph whose symbolic sizes are hinted at this length,
in a fresh shape environment, under a tracing context of that environment. DeepSpeed's length guards stay
there: Dynamo never recompiles. The peaks are those of a fresh program per length (tests/experiments/
test_simulate.py); the probes of a whole table cell are byte-identical to before (closing note of issue 10).
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._python_dispatch import _disable_current_modes


def per_length(backend: Callable[[fx.GraphModule, list[Any]], Callable]) -> Callable:
    """A Dynamo backend compiling `gm` with `backend` once per length, as if traced at that length."""

    def compile_symbolic(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        compiled: dict[tuple[int, ...], Callable] = {}
        gm = _snapshot(gm)  # as Dynamo hands it over (it strips the placeholders' `grapharg` after compiling)

        def run(*args: Any) -> Any:
            key = tuple(a for a in args if isinstance(a, int) and not isinstance(a, bool))
            if key not in compiled:  # no part of the step: unseen by a memory tracker, as Dynamo's compile
                with _disable_current_modes():
                    graph, inputs, context = hinted_at(gm, list(args))
                    with tracing(context):
                        compiled[key] = backend(graph, inputs)
            return compiled[key](*args)

        return run

    return compile_symbolic


def hinted_at(gm: fx.GraphModule, args: list[Any]) -> tuple[fx.GraphModule, list[Any], TracingContext]:
    """A copy of Dynamo's symbolic `gm` as Dynamo builds it for the call `args`: its symbolic dimensions (the
    sequence: one symbol, as Dynamo's equality guards leave them) hinted at these sizes in a fresh shape
    environment (the placeholders' `example_value`: DeepSpeed's pass propagates the rest itself, from its
    inputs); the example inputs Dynamo passes a backend; a tracing context of that environment."""
    from torch._dynamo import config

    env = ShapeEnv(allow_scalar_outputs=config.capture_scalar_outputs,
                   allow_dynamic_output_shape_ops=config.capture_dynamic_output_shape_ops,
                   prefer_deferred_runtime_asserts_over_guards=(
                       config.prefer_deferred_runtime_asserts_over_guards))
    mode = FakeTensorMode(shape_env=env)
    graph = _snapshot(gm)
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise RuntimeError(f"Dynamo's graph takes {len(placeholders)} inputs, called with {len(args)}")
    symbols: dict[Any, torch.SymInt] = {}  # Dynamo's symbol -> this length's
    fakes: list[Any] = list(args)
    for i, (node, arg) in enumerate(zip(placeholders, args)):
        old = node.meta["example_value"]
        if isinstance(arg, torch.Tensor):
            # symbolic dimensions duck-sized: the sequence's get one symbol, as Dynamo's guards left them
            dims = [DimDynamic.DUCK if isinstance(d, torch.SymInt) else DimDynamic.STATIC for d in old.shape]
            context = StatelessSymbolicContext(dynamic_sizes=dims, constraint_sizes=[None] * len(dims))
            source = node.meta["grapharg"].source
            fakes[i] = fake = mode.from_tensor(arg, source=source, symbolic_context=context)
            symbols.update((d.node.expr, n) for d, n in zip(old.shape, fake.shape)
                           if isinstance(d, torch.SymInt))
    for i, (node, arg) in enumerate(zip(placeholders, args)):
        old = node.meta["example_value"]
        if isinstance(old, torch.SymInt):
            if old.node.expr not in symbols or symbols[old.node.expr].node.hint != arg:
                raise RuntimeError(f"Dynamo's size input {node.name} ({old}) is no tensor size of this call")
            fakes[i] = symbols[old.node.expr]
            if node.name == str(old.node.expr) != str(fakes[i]):  # DeepSpeed finds it by its symbol's name
                node._rename(str(fakes[i]))
    for node in graph.graph.nodes:  # the rest DeepSpeed's pass propagates itself (Dynamo's: another env's)
        node.meta.pop("example_value", None)
    for node, fake in zip(placeholders, fakes):
        node.meta["example_value"] = fake
    graph.recompile()
    return graph, [f if isinstance(f, torch.SymInt) else a for f, a in zip(fakes, args)], TracingContext(mode)


def _snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose graph and node metadata (example values, Dynamo's graph args, DeepSpeed's input
    tags) are its own: DeepSpeed's pass rewrites the graph it gets. Dynamo's attributes come along:
    aot_autograd reads the inputs' sources there (a parameter is a static input, saved for free)."""
    graph = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    graph.meta = dict(gm.meta)
    for name in _DYNAMO_GRAPH_ATTRIBUTES:
        if hasattr(gm, name):
            setattr(graph, name, getattr(gm, name))
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), graph.graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return graph


#: what Dynamo attaches to the graph module it hands a backend, outside `meta` (`_call_user_compiler`)
_DYNAMO_GRAPH_ATTRIBUTES = ("_param_name_to_source", "_source_to_user_stacks")
