"""Byte sizes as users write them ('512MiB', '1.5GiB', '800MB', '4096'): the one parser, for the compiler's byte
budgets (`--sac budget=32MiB`) and the harness's sizes (`--memory-budget`)."""
from __future__ import annotations

import re

from autosp.errors import ConfigError

#: binary units KiB/MiB/GiB/TiB, decimal KB/MB/GB/TB; no unit or B: bytes
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def split_size(text: str) -> tuple[float, str] | None:
    """(number, lower-case unit) of a size written as a number and a known unit ('' for none), else None."""
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in UNITS:
        return None
    return float(match.group(1)), match.group(2).lower()


def parse_size(text: str | int) -> int:
    """Bytes from '512MiB', '1.5GiB', '800MB', '4096' (binary units KiB/MiB/GiB/TiB, decimal KB/MB/GB/TB)."""
    if isinstance(text, int):
        value = text
    else:
        size = split_size(text)
        if size is None:
            raise ConfigError(f"cannot read the size {text!r}; write e.g. 512MiB, 1.5GiB, 800MB or a byte count")
        value = int(size[0] * UNITS[size[1]])
    if value <= 0:
        raise ConfigError(f"a size must be positive, got {text!r}")
    return value
