"""An internal error inside one step of the SP walk, reported as one line naming what raised it.

A torch error deep in a step (a fake tensor reaching a kernel that reads data, a shape the step failed to adapt:
"Expected size for first two dimensions of batch2 tensor") says nothing a user can act on. `attributed` turns it
into a `SequenceParallelError` that names the node and the module path Dynamo recorded for it, the step that raised
(the innermost frame in `autosp/compiler`), and the pattern the walk saw: which inputs were sharded along which
dimension and which were full. AutoSP's own refusals pass through unchanged.
"""
from __future__ import annotations

import contextlib
import os
import re
import traceback
from collections.abc import Iterator

import torch
import torch.fx as fx

from autosp.compiler.sp.spec import ShardSpec, SPContext, node_label
from autosp.errors import SequenceParallelError

_COMPILER = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def attributed(ctx: SPContext, node: fx.Node) -> Iterator[None]:
    """Run one node's rewrite; an exception other than AutoSP's own becomes one line about `node`."""
    try:
        yield
    except SequenceParallelError:
        raise
    except Exception as e:  # noqa: BLE001 - any internal error is reported against the node that raised it
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        target = getattr(node.target, "__name__", node.target)
        raise SequenceParallelError(
            f"AutoSP's SP pass failed at {node_label(node)} ({target}) in {_step(e)}, seeing {_pattern(ctx, node)}: "
            f"{type(e).__name__}: {first} (an internal error of AutoSP: report it with this line)") from e


def _step(error: Exception) -> str:
    """`sp/routing.py:gather_spec`: the innermost frame of the compiler in the error's traceback ('running the op
    on this rank's shard' for SPContext.run, the fake-tensor evaluation of the node itself)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.abspath(f.filename).startswith(_COMPILER) and not f.filename.endswith("attribution.py")]
    if not frames:
        return "the walk"
    frame = frames[-1]
    if frame.name == "run" and frame.filename.endswith(os.path.join("sp", "spec.py")):
        return "running the op on this rank's shard"
    return f"{os.path.relpath(frame.filename, _COMPILER)}:{frame.name}"


def _pattern(ctx: SPContext, node: fx.Node) -> str:
    """Each tensor input as the walk saw it: sharded (`x: sequence on dim 1, 16 of 32`) or full (its shape)."""
    seen = []
    for n in node.all_input_nodes:
        name = re.sub(r".*_modules_", "", n.name)  # Dynamo's parameter names: `down_proj_parameters_weight_`
        spec = ctx.specs.get(n)
        if isinstance(spec, tuple):
            spec = next((s for s in spec if s is not None), None)
        if isinstance(spec, ShardSpec):
            seen.append(f"{name}: sequence on dim {spec.dim}, {spec.length} of {spec.global_len}")
        else:
            value = ctx.current.get(n, ctx.original.get(n))
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            seen.append(f"{name}: full {shape}")
    return "[" + "; ".join(seen) + "]" if seen else "no inputs"
