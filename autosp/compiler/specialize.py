"""Sequence lengths marked dynamic (`torch._dynamo.mark_dynamic`): trace once, specialise per length.

Dynamo hands a graph whose sizes are SymInt placeholders. Sharding decisions (which dim carries the sequence,
where a shard starts) are made on concrete sizes, so the backend binds the SymInts to the values of each call,
re-propagates fake shapes, and compiles that static graph once per length. Dynamo traces the model only once and
never recompiles (or hits its recompile limit) when a length search or a data loader changes the length.
`autosp.compile` gets the symbolic trace without `mark_dynamic` too: a length that differs from the first call's
makes Dynamo retrace once with the length symbolic (automatic dynamic shapes). Each specialisation is logged
(logger `autosp`, INFO) with the count so far.
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

logger = logging.getLogger("autosp")


def is_symbolic(example_inputs: list[Any]) -> bool:
    return any(isinstance(x, torch.SymInt) for x in example_inputs)


def bind_sizes(gm: fx.GraphModule, inputs: list[Any]) -> fx.GraphModule:
    """A static copy of `gm` for these inputs: SymInt placeholders replaced by their values, fake shapes redone."""
    static = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    placeholders = [n for n in static.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, inputs, strict=True):
        if isinstance(value, int) and not isinstance(value, bool):
            node.replace_all_uses_with(value)  # type: ignore[arg-type]  (FX args may be plain ints)
    static.recompile()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    with mode, torch.enable_grad():  # propagate requires_grad as Dynamo did for the training graph
        _RecordValues(static).run(*fake_inputs)
    for node, x in zip(placeholders, inputs, strict=True):  # parameters stay recognisable to the analysis
        if isinstance(x, torch.nn.Parameter):
            node.meta["example_value"] = torch.nn.Parameter(node.meta["example_value"], requires_grad=x.requires_grad)
    return static


class _RecordValues(fx.Interpreter):
    def run_node(self, node: fx.Node) -> Any:
        node.meta["example_value"] = value = super().run_node(node)
        return value


def per_length(gm: fx.GraphModule, compile_static: Callable[[fx.GraphModule, list[Any]], Callable]) -> Callable:
    """A callable that compiles (once) and runs the static specialisation for each distinct set of sizes."""
    compiled: dict[tuple[int, ...], Callable] = {}

    def run(*args: Any) -> Any:
        key = tuple(a for a in args if isinstance(a, int) and not isinstance(a, bool))
        if key not in compiled:  # compiling is no part of the step: unseen by the caller's dispatch modes, as
            with _disable_current_modes():  # Dynamo's own compile is (e.g. a memory tracker's, autosp simulate)
                compiled[key] = compile_static(bind_sizes(gm, list(args)), list(args))
            logger.info("autosp: compiled the graph for sizes %s (%d specialisations of one trace)", key,
                        len(compiled))
        return compiled[key](*args)

    return run
