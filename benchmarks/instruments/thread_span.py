"""Where a span of one thread's wall time went (`ThreadSpan`): on a CPU, runnable but waiting for
one, or blocked, with its blocking waits, major faults and the process's garbage collections
meanwhile. For rare events a donor waits on, such as a borrower's reclaim fence (its log line)."""

from __future__ import annotations

import gc
import resource
import time
from dataclasses import dataclass


def _runnable_wait_s() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux schedstat's
    run delay); 0.0 where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _thread_usage() -> tuple[int, int]:
    """(voluntary context switches, major page faults) of the calling thread so far."""
    try:
        ru = resource.getrusage(resource.RUSAGE_THREAD)
    except (AttributeError, OSError, ValueError):  # not Linux
        return 0, 0
    return ru.ru_nvcsw, ru.ru_majflt


@dataclass(frozen=True)
class ThreadSplit:
    """Where a span of one thread's wall time went: on a CPU, runnable but waiting for one (the
    machine busy), or blocked (waiting for the GIL, a lock, a page read from disk), with how
    many times it blocked, its major page faults, and the garbage collections, by generation,
    that any thread of the process ran meanwhile (a collection holds the GIL)."""

    wall_ms: float
    cpu_ms: float
    runnable_ms: float
    blocked_ms: float
    blocked_times: int
    major_faults: int
    collections: tuple[int, ...]

    def describe(self) -> str:
        return (f"this thread {self.cpu_ms:.2f} ms on a CPU, {self.runnable_ms:.2f} ms runnable "
                f"waiting for one, {self.blocked_ms:.2f} ms blocked in {self.blocked_times} "
                f"waits (GIL, lock, disk), {self.major_faults} major faults; garbage "
                f"collections meanwhile gen0/1/2 " + "/".join(map(str, self.collections)))


class ThreadSpan:
    """Start measuring the calling thread; `split()` (on the same thread) says where its time
    went since (`ThreadSplit`). About 0.1 ms for both (measured here under load): for rare
    events such as a reclaim."""

    def __init__(self) -> None:
        self._collections = [g["collections"] for g in gc.get_stats()]
        self._usage = _thread_usage()
        self._runnable = _runnable_wait_s()
        self._cpu = time.thread_time()
        self._wall = time.perf_counter()

    def split(self) -> ThreadSplit:
        wall = time.perf_counter() - self._wall
        cpu = time.thread_time() - self._cpu
        runnable = max(0.0, _runnable_wait_s() - self._runnable)
        switches, faults = (a - b for a, b in zip(_thread_usage(), self._usage))
        collections = tuple(g["collections"] - n for g, n in zip(gc.get_stats(),
                                                                  self._collections))
        return ThreadSplit(wall * 1e3, cpu * 1e3, runnable * 1e3,
                           max(0.0, wall - cpu - runnable) * 1e3, switches, faults, collections)
