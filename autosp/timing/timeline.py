"""The streams one rank's step runs on, and what they leave exposed (`Timeline`, `StepTime`).

Ops are issued in program order. On a GPU (`streams=True`) compute ops run in order on the compute stream,
collectives on a communication stream and host copies on a copy stream, each stream in order; an op starts when
its stream is free and every value it reads is ready (the producer's end). So a copy or a collective hides behind
whatever compute the program's order puts between it and its first reader, and is exposed by however long its
reader waits for it; what is still running when the compute stream ends is exposed too. On a CPU
(`streams=False`) everything runs in line on one thread: every copy and collective is exposed whole.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

#: the op classes and the stream each runs on (a class's seconds are summed in `StepTime.by_class`)
STREAM_OF = {"matmul": "compute", "attention": "compute", "memory": "compute", "host": "compute",
             "zero3_hooks": "compute", "collective": "comm", "copy": "copy"}


@dataclass
class StepTime:
    """One step's predicted seconds: the step, busy seconds per op class, the seconds of collectives and copies
    that the compute stream waited for (exposed), and FLOPs executed (recompute included)."""

    iteration_s: float = 0.0
    exposed_collective_s: float = 0.0
    exposed_copy_s: float = 0.0
    executed_flops: float = 0.0
    by_class: dict[str, float] = field(default_factory=dict)

    def line(self, other: StepTime, more: int) -> StepTime:
        """The step `more` layers past `other`, with `self` one layer fewer than `other` (identical layers)."""
        def at(a: float, b: float) -> float:
            return b + more * (b - a)

        return StepTime(iteration_s=at(self.iteration_s, other.iteration_s),
                        exposed_collective_s=at(self.exposed_collective_s, other.exposed_collective_s),
                        exposed_copy_s=at(self.exposed_copy_s, other.exposed_copy_s),
                        executed_flops=at(self.executed_flops, other.executed_flops),
                        by_class={k: at(self.by_class.get(k, 0.0), v) for k, v in other.by_class.items()})


class Timeline:
    """Program-ordered ops on a device's streams (see the module docstring); values are keyed by any hashable id."""

    def __init__(self, streams: bool) -> None:
        self.streams = streams
        self.free: dict[str, float] = defaultdict(float)  # stream -> when its last op ends
        self.ready: dict[object, tuple[float, str]] = {}  # value -> when it is ready, and the stream that made it
        self.time = StepTime(by_class=defaultdict(float))

    def run(self, op_class: str, seconds: float, reads: Iterable[object] = (), writes: Iterable[object] = (),
            flops: float = 0.0) -> float:
        """Issue one op that reads and writes the given values; returns when it ends."""
        stream = STREAM_OF[op_class] if self.streams else "compute"
        start = self.free[stream]
        for value in reads:
            ready, producer = self.ready.get(value, (0.0, "compute"))
            if ready > start:
                if stream == "compute" and producer != "compute":  # the compute stream waits for a copy/collective
                    self._expose(producer, ready - start)
                start = ready
        end = self.free[stream] = start + seconds
        for value in writes:
            self.ready[value] = (end, stream)
        self.time.by_class[op_class] += seconds
        self.time.executed_flops += flops
        if not self.streams and op_class in ("collective", "copy"):
            self._expose(STREAM_OF[op_class], seconds)
        return end

    def _expose(self, stream: str, seconds: float) -> None:
        if stream == "comm":
            self.time.exposed_collective_s += seconds
        else:
            self.time.exposed_copy_s += seconds

    def finish(self) -> StepTime:
        """The step ends when its last stream does: what runs past the compute stream's end is exposed
        (collectives first, then copies beyond them, so the tail is charged once)."""
        compute = self.free["compute"]
        comm_end = max(compute, self.free["comm"])
        self._expose("comm", comm_end - compute)
        self._expose("copy", max(0.0, self.free["copy"] - comm_end))
        self.time.iteration_s = max(self.free.values(), default=0.0)
        self.time.by_class = dict(self.time.by_class)
        return self.time
