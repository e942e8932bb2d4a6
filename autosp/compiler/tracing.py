"""How Dynamo traces the model for AutoSP: one whole graph, with logging calls left out of it.

The SP pass needs the whole forward as one graph. A model that logs (`logger.warning(...)`, HF's
`logger.warning_once`, `warnings.warn`) would otherwise break the graph there; Dynamo can skip such calls
(`ignore_logger_methods`), which changes nothing the model computes, only that the message is not printed
inside the compiled region.

HF models install their output-capturing hooks (router logits, hidden states) on first use, under a
`threading.Lock` Dynamo cannot enter; `install_output_hooks` installs them before tracing instead. HF's flex mask
reads a padding `attention_mask`'s values to decide whether to apply it (a graph break); traced for AutoSP, it
applies it unread, as HF's SDPA and eager masks do when traced.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator

import torch

from autosp.compiler.sp import (
    trace_gated_delta_rules,
    trace_lightning_attention,
    trace_selective_scans,
    trace_ssd_scans,
)

_LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")


def logging_calls() -> set[Callable]:
    """Every logger method (including ones libraries add to `logging.Logger`, e.g. HF's `warning_once`) and
    `warnings.warn`. Read at trace time, so methods added by a library imported after `autosp` count too."""
    methods = {getattr(logging.Logger, name) for name in dir(logging.Logger)
               if name in _LOGGER_METHODS or (name.endswith("_once") and callable(getattr(logging.Logger, name)))}
    return methods | {warnings.warn}


@contextlib.contextmanager
def tracing_config() -> Iterator[None]:
    """Dynamo settings for tracing a model for AutoSP (see the module docstring)."""
    ignored = set(torch._dynamo.config.ignore_logger_methods) | logging_calls()
    with torch._dynamo.config.patch(ignore_logger_methods=ignored), _hf_padding_mask_traced(), \
            trace_gated_delta_rules(), trace_ssd_scans(), trace_selective_scans(), trace_lightning_attention():
        yield


def _fast_all_traced(tensor: torch.Tensor) -> bool | torch.Tensor:
    """HF's `fast_all`, False while Dynamo traces: the padding mask is then applied, not tested first."""
    return False if torch.compiler.is_compiling() else _fast_all_traced.original(tensor)


@contextlib.contextmanager
def _hf_padding_mask_traced() -> Iterator[None]:
    """HF's flex mask applies a padding `attention_mask` only if some entry is 0 (`fast_all`, a branch on tensor
    values: a graph break), where its SDPA and eager masks apply it unread while traced. Traced, AutoSP always
    applies it: the same mask (all ones: AND with true)."""
    utils = sys.modules.get("transformers.masking_utils")
    if utils is None or getattr(utils, "fast_all", _fast_all_traced) is _fast_all_traced:
        yield
        return
    _fast_all_traced.original = utils.fast_all
    utils.fast_all = _fast_all_traced
    try:
        yield
    finally:
        utils.fast_all = _fast_all_traced.original


def install_output_hooks(model: torch.nn.Module) -> None:
    """Install HF transformers' output-capturing hooks on `model`'s HF models now (nothing for other models)."""
    if "transformers" not in sys.modules:
        return
    from transformers import PreTrainedModel
    from transformers.utils.output_capturing import maybe_install_capturing_hooks

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            maybe_install_capturing_hooks(module)


def _last_user_frame(message: str) -> str:
    """`file.py:line (code)` of the innermost model frame Dynamo's message quotes, or '' when it quotes none."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.+)', message)
    if not frames:
        return ""
    path, line, code = frames[-1]
    return f" at {os.path.basename(path)}:{line} (`{code.strip()}`)"


def _breaking(model: torch.nn.Module, error: Exception) -> tuple[str, torch.nn.Module] | None:
    """(name, module): the innermost submodule of `model` whose `forward` Dynamo's error stack passes through (its
    first instance), or None when the stack names none."""
    owners: dict[tuple[str, int], tuple[str, torch.nn.Module]] = {}
    for name, module in model.named_modules():
        code = getattr(type(module).forward, "__code__", None)
        if code is None:
            continue
        for _, _, line in code.co_lines():
            if line is not None:
                owners.setdefault((code.co_filename, line), (name, module))
    for frame in reversed(getattr(error, "real_stack", None) or []):
        owner = owners.get((frame.filename, frame.lineno))
        if owner:
            return owner
    return None


def breaking_module(model: torch.nn.Module, error: Exception) -> str:
    """` in `name` (Class)`: the innermost submodule of `model` whose `forward` Dynamo's error stack passes through
    (the layer that broke the graph; its first instance), or '' when the stack names none."""
    owner = _breaking(model, error)
    return f" in `{owner[0] or 'the model'}` ({type(owner[1]).__name__})" if owner else ""


def data_dependent_shape_error(model: torch.nn.Module, error: Exception) -> str:
    """One line for Dynamo's UserError on a size computed from tensor values. Inside HF's experts module run as
    its eager loop (`experts_implementation="eager"`: one iteration per expert hit, a count read from the routing)
    the line names the module and the fix: HF's static-shape `batched_mm`, which AutoSP shards exactly."""
    message = str(error)
    reason = message.strip().splitlines()[0] if message.strip() else type(error).__name__
    owner = _breaking(model, error)
    config = getattr(owner[1], "config", None) if owner else None
    if getattr(config, "_experts_implementation", None) == "eager":
        return (f"`{owner[0]}` ({type(owner[1]).__name__}) runs HF's eager experts loop{_last_user_frame(message)}, "
                "whose loop bound (the experts hit) is read from tensor values, and AutoSP needs one static-shape "
                'graph: build the model with experts_implementation="batched_mm" (static shapes, exact under '
                "AutoSP) or keep the default grouped_mm")
    return (f"AutoSP needs one static-shape graph, but the model computes a size or a loop bound from tensor values"
            f"{breaking_module(model, error)}{_last_user_frame(message)}: {reason[:160]}; remove the data-dependent "
            "size or loop (for HF mixture-of-experts: experts_implementation=\"batched_mm\", not \"eager\")")
