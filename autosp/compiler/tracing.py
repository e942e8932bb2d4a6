"""How Dynamo traces the model for AutoSP: one whole graph, with logging calls left out of it.

The SP pass needs the whole forward as one graph. A model that logs (`logger.warning(...)`, HF's
`logger.warning_once`, `warnings.warn`) would otherwise break the graph there; Dynamo can skip such calls
(`ignore_logger_methods`), which changes nothing the model computes, only that the message is not printed
inside the compiled region.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator

import torch

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
    with torch._dynamo.config.patch(ignore_logger_methods=ignored):
        yield
