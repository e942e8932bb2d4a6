"""One-off (not part of the package): the memory rate by an op's bytes re-tried on top of the wait, without merging it.

Prices `reprice.py`'s traces on the package's cpu row with memory-bound ops at the rate of their size: the
multipliers the memory-by-bytes page measured (10:35 UTC, `memory_by_bytes` at tag attempt/memory-by-bytes-2026-12-07),
linear in log2 of the bytes between sizes, the ends' beyond (the row's own interpolation); with the row's wait
and without it.

    python memory_retry.py MEASURED.jsonl ..."""
import sys
from dataclasses import replace

from reprice import CELLS, measured, traces

import autosp.timing.rates as rates_module

MULTIPLIERS = [(786432, 16.65), (3145728, 17.01), (12582912, 15.12), (25165824, 9.589), (50331648, 5.214),
               (100663296, 1.0)]


def by_bytes(self, nbytes: float) -> float:
    """The op's bytes at the rate of their size: the row's own log2 interpolation between measured sizes
    (`DeviceRates.attention_rate`, fed the sizes and rates in place of key lengths)."""
    table = replace(self, attention_by_keys=tuple((size, self.memory_bytes_s * m) for size, m in MULTIPLIERS))
    return nbytes / table.attention_rate(int(nbytes)) if nbytes > 0 else 0.0


if __name__ == "__main__":
    cells = traces()
    row = rates_module.device_rates("cpu")
    one_rate = rates_module.DeviceRates.memory_seconds
    for name, memory, rates in (("row", one_rate, row), ("row, memory by bytes", by_bytes, row),
                                ("row, memory by bytes, no wait", by_bytes, replace(row, collective_wait_s=0.0))):
        rates_module.DeviceRates.memory_seconds = memory
        for path in sys.argv[1:]:
            steps = measured(path)
            errors = [cells[c].time(rates, 2).iteration_s / steps[c] - 1 for c in CELLS]
            print(f"{name:30s} {path.rsplit('/', 1)[-1]:42s} within {sum(abs(e) <= 0.15 for e in errors):2d}/12 "
                  f"sum|e| {100 * sum(map(abs, errors)):4.0f}  " + " ".join(f"{100 * e:+.0f}" for e in errors))
