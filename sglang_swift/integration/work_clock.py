"""Where a SwiftCache server's scheduler thread spends its own time, by phase.

Every entry point SGLang's scheduler calls on the cache is one phase (`PHASES`); a phase called
from inside another (an eviction asked for by `init_load_back`'s allocation) is counted in its
own phase and taken out of the caller's, so the phases add up to the scheduler thread's time in
SwiftCache's code. Two clock reads per call; the scheduler thread is the only caller.

The totals go to `/metrics` (with `--enable-metrics`) as `swiftcache_work_<phase>_seconds_total`,
with `swiftcache_scheduler_loops_total`, the scheduler loop iterations seen, so a benchmark can
divide by its own steps or requests (`bench_sched_overhead.py`, `bench_node.py --closed-loop`).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

PHASES = {  # phase -> what it covers
    "match": "prefix matches (admission and SGLang's own lookups)",
    "insert": "inserts of finished and unfinished requests' KV",
    "lock": "lock reference changes of matched and inserted paths",
    "evict": "evictions, with the stores of their victims (evict_wait_s is that part)",
    "load_back": "init_load_back: slots and copies queued for a lower-tier hit",
    "batch_start": "a prefill batch's loads and exchanges started under its forward",
    "batch_settle": "a batch's loads judged after its forward",
    "loop": "the per-loop hook: finished copies, control events, lending, metrics",
}


class WorkClock:
    """Seconds by phase; nested phases count once, in the innermost."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.loops = 0
        self._stack: list[list] = []  # [phase, start, time spent in nested phases]

    def enter(self, phase: str) -> None:
        self._stack.append([phase, self.clock(), 0.0])

    def leave(self) -> None:
        phase, start, nested = self._stack.pop()
        took = self.clock() - start
        self.seconds[phase] += took - nested
        if self._stack:
            self._stack[-1][2] += took


def timed(phase: str) -> Callable:
    """Count a cache method's time in `phase` (the instance's `work` clock)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; use one of {sorted(PHASES)}")

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            clock = self.work
            clock.enter(phase)
            try:
                return fn(self, *args, **kwargs)
            finally:
                clock.leave()
        return run
    return wrap
