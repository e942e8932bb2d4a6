"""A progress bar for long work (suites, sweeps, searches): which cell, how many left, elapsed.

tqdm draws it on stderr only when stderr is a terminal, so logs of Snakemake jobs, CI and tests stay clean.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T] | None = None, *, desc: str, total: int | None = None, unit: str = "cell") -> tqdm:
    """A tqdm bar over `items` (or one to `update()` by hand); disabled when stderr is not a terminal."""
    return tqdm(items, desc=desc, total=total, unit=unit, dynamic_ncols=True, leave=False,
                disable=not sys.stderr.isatty())
