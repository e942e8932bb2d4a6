"""One-off (not part of the package): the check's 1K cells' collectives by kind and bytes sent (count, priced
seconds on the committed cpu row), from the traces `reprice.py` simulates. Run from
docs/measurements/2026-12-07-collective-waits: `python ../2026-12-07-collectives-by-bytes/collectives_of.py`."""
import collections
import sys

sys.path.insert(0, ".")
import reprice  # noqa: E402

from autosp.timing.rates import collective_bytes, device_rates  # noqa: E402

rates = device_rates("cpu")
for cell, trace in reprice.traces().items():
    if cell[1] != 1024:
        continue
    events = trace.events if hasattr(trace, "events") else trace.high.events
    by = collections.Counter()
    secs = collections.Counter()
    for op_class, quantity, kind, group, *_ in events:
        if op_class == "collective" and group > 1:
            key = (kind, int(collective_bytes(kind, quantity, group)))
            by[key] += 1
            secs[key] += rates.collective_seconds(kind, quantity, group, 8)
    total = sum(secs.values())
    print(cell, f"{sum(by.values())} collectives, {total:.3f} s priced")
    for key, n in sorted(by.items(), key=lambda kv: -secs[kv[0]])[:8]:
        print(f"   {key[0]:15s} {key[1]:>10,d} B sent x {n:4d}: {secs[key]:.3f} s")
