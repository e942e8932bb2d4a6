"""The memory planner's search along one ladder (`planner`): the fewest layers k whose rung fits, each rung a min-cut
partition of the whole joint graph, so the search asks for as few as it can."""
from __future__ import annotations

import math
from typing import Any


def smallest_fitting_rung(make: Any, count: int, fits: Any, budget: int | None) -> Any:
    """The smallest k in 1..count whose rung `make(k)` `fits`, or None where `make(count)` does not; `make(0)` is a rung
    already made that does not fit. Assuming fitting is monotone in k (each rung recomputes more), any k that fits
    with k - 1 not fitting is that one; the next k is guessed where the bracket's lower peak, falling by the saved
    bytes each layer of the bracket sheds (its two rungs' `saved`; their peaks where the saved bytes do not fall),
    crosses `budget`: a rung's peak falls with what it saves until another part of the program binds (a recomputed
    layer's backward), which the line through the two peaks would average in. A bisection step follows two guesses
    that did not halve the bracket: at 32 layers two or three rungs beyond the top one, where bisection makes five."""
    top = make(count)
    if not fits(top):
        return None
    (bad, below), (good, best) = (0, make(0)), (count, top)
    misses = 0  # guesses in a row that did not halve the bracket
    while good - bad > 1:
        width = good - bad
        # the bytes the bracket's layers shed: its saved values, else (none shed on the device: moved to host memory)
        # its peaks; where neither falls (a rung over the host budget within the device's), bisection
        shed = below.saved - best.saved if below.saved > best.saved else below.peak - best.peak
        guess = misses < 2 and budget is not None and below.peak > budget and shed > 0
        k = bad + math.ceil((below.peak - budget) * width / shed) if guess else (bad + good) // 2
        k = min(max(k, bad + 1), good - 1)
        t = make(k)
        if fits(t):
            good, best = k, t
        else:
            bad, below = k, t
        misses = misses + 1 if guess and 2 * (good - bad) > width else 0
    return best
