"""Step time of the host optimizer with and without its step overlapped with backward (`overlap_step`,
`autosp.comm.early_step`), on CPU, one process: a stack of linear layers (the parameters large enough for the host
AdamW step to cost about what backward does), steps of the two optimizers interleaved (A B A B ...) so a drifting
machine moves both; per step the wall time of backward + step, medians and the ratio of each pair's times.
Backward runs on one intra-op thread, the worker steps on another core (as a GPU's host has idle cores during
backward). `flock ~/.autosp-measure.lock python -m tests.comm.overlap_step_time [tokens] [steps]`
(docs/measurements/2026-12-05-overlap-step.md)."""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from autosp.comm.host_optimizer import HostMasters, HostOptimizer

WIDTH, LAYERS, WARMUP = 1024, 8, 2


def _setup(overlap: bool) -> tuple[torch.nn.Module, HostOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    masters = HostMasters.capture(model.parameters(), None)
    return model, HostOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, masters=masters,
                                overlap_step=overlap, lr=1e-4)


def _step(model: torch.nn.Module, optimizer: HostOptimizer, x: torch.Tensor) -> float:
    start = time.perf_counter()
    with optimizer.overlapping():
        model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(tokens: int = 64, steps: int = 10) -> None:
    torch.set_num_threads(1)
    plain, overlapped = _setup(False), _setup(True)
    times: dict[str, list[float]] = {"plain": [], "overlap": []}
    for step in range(WARMUP + steps):
        x = torch.randn(tokens, WIDTH, generator=torch.Generator().manual_seed(step))
        pair = {"plain": _step(*plain, x), "overlap": _step(*overlapped, x)}
        if step >= WARMUP:
            for name, seconds in pair.items():
                times[name].append(seconds)
    for p, q in zip(plain[0].parameters(), overlapped[0].parameters(), strict=True):
        assert torch.equal(p, q), "the overlapped step's parameters differ from the plain step's"
    ratios = [o / p for o, p in zip(times["overlap"], times["plain"], strict=True)]
    print(json.dumps({
        "tokens": tokens, "parameters": sum(p.numel() for p in plain[0].parameters()), "steps": steps,
        "early_steps": overlapped[1].early_steps, "rolled_back": overlapped[1].early.rolled_back,
        **{f"{k}_median_s": round(statistics.median(v), 4) for k, v in times.items()},
        **{f"{k}_min_max_s": [round(min(v), 4), round(max(v), 4)] for k, v in times.items()},
        "ratio_median": round(statistics.median(ratios), 3), "ratio_min_max": [round(min(ratios), 3),
                                                                             round(max(ratios), 3)]}))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
