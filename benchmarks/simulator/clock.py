"""The simulated clock: a heap of (time, seq, callback). Nothing here sleeps or reads wall time."""

from __future__ import annotations

import heapq
from typing import Callable


class EventLoop:
    """Runs callbacks in time order; ties run in the order they were scheduled (FIFO by `seq`)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.events_run = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run `fn` at absolute time `t` (must not be in the past)."""
        if t < self.now - 1e-12:
            raise ValueError(f"cannot schedule at {t} < now {self.now}")
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn))
        self._seq += 1

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.now + dt, fn)

    def run(self, until: float = float("inf")) -> None:
        """Pop events until the heap is empty or the next one is later than `until`."""
        while self._heap and self._heap[0][0] <= until:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            self.events_run += 1
            fn()
        if until != float("inf") and self.now < until and not self._heap:
            self.now = until

    def pending(self) -> int:
        return len(self._heap)
