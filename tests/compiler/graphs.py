"""Capture Dynamo's Torch-IR graph of a model call, for graph-level tests of the SP pass (no process group)."""
from __future__ import annotations

import torch
import torch.fx as fx


def capture(model: torch.nn.Module, **kwargs) -> tuple[fx.GraphModule, list]:
    """(Dynamo's graph of `model(**kwargs)`, its example inputs)."""
    captured = []

    def grab(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=grab, fullgraph=True, dynamic=False)(**kwargs)
    return captured[0]


def count(gm: fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is target)


def partitioned(gm: fx.GraphModule, inputs: list) -> list[fx.GraphModule]:
    """The forward and backward graphs aot_autograd's default partition makes of `gm` (after the SP pass)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition

    graphs: list[fx.GraphModule] = []

    def partition(joint, joint_inputs, **kwargs):
        graphs.extend(default_partition(joint, joint_inputs, **kwargs))
        return graphs

    aot_module_simplified(gm, inputs, fw_compiler=lambda g, _: g.forward, partition_fn=partition)
    return graphs
