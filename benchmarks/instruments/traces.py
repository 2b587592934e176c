"""The benchmarks' observers on the product's debug seam, installed in a server process by
`SWIFTCACHE_INSTRUMENTS=benchmarks.instruments.traces:install` (see `instruments_env`):

- SWIFTCACHE_FORWARD_TRACE=<file>: one JSON line per forward pass (streamed or not): mode, size,
  wall and thread CPU time, the streamed pool's copies within it, the thread's minor page faults
  and the runs of consecutive slots its new tokens' KV went to (`forward_record`);
- SWIFTCACHE_LOAD_TRACE=<file>: one JSON line per borrower batch load (scripts/bench_overlap.py's
  timeline): the facts the product hands the seam, as they are;
- SWIFTCACHE_RECLAIM_SPLIT=1: where a borrower's reclaim fence spent its thread's time
  (`ThreadSpan`), appended to the acknowledgement's log line;
- SWIFTCACHE_STEP_TRACE=<file>: one JSON line per scheduler loop iteration that ran a forward:
  its wall time (from its start to the next iteration's) and its forwards' (`StepTimer`).
Each file is read from the environment at install, in the server's start-up.
"""

from __future__ import annotations

import json
import os
import resource
import time
from typing import Any, Mapping

from .thread_span import ThreadSpan

FORWARD_TRACE_ENV = "SWIFTCACHE_FORWARD_TRACE"
LOAD_TRACE_ENV = "SWIFTCACHE_LOAD_TRACE"
RECLAIM_SPLIT_ENV = "SWIFTCACHE_RECLAIM_SPLIT"
STEP_TRACE_ENV = "SWIFTCACHE_STEP_TRACE"
COPY_FIELDS = ("copy_s", "rows_loaded", "rows_saved")


def install(observers: Any, environ: Mapping[str, str] | None = None) -> None:
    """Set the seam's observers the environment (default: this process's) asks for."""
    environ = os.environ if environ is None else environ
    forward, loads = environ.get(FORWARD_TRACE_ENV), environ.get(LOAD_TRACE_ENV)
    if forward:
        observers.forward = forward_observer(forward)
    if loads:
        observers.batch_load = lambda facts: append_line(loads, facts)
    if environ.get(RECLAIM_SPLIT_ENV) == "1":
        observers.reclaim_fence = reclaim_split
    steps = environ.get(STEP_TRACE_ENV)
    if steps:
        timer = StepTimer(steps, observers.forward)
        observers.step, observers.forward = timer.mark, timer.forward


def append_line(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def minor_faults() -> int:
    """Minor page faults of the calling thread so far (first touches of memory)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def forward_observer(path: str):
    """The `forward` point: measures each forward of the calling (scheduler) thread."""

    def observe(runner: Any, forward_batch: Any):
        pool = getattr(runner, "token_to_kv_pool", None)
        streamed = getattr(pool, "begin_layer_stream", None) is not None
        before = dict(pool.stream_stats()) if streamed else None
        wall, cpu, faults = time.perf_counter(), time.thread_time(), minor_faults()

        def done() -> None:
            copies = {}
            if streamed:
                after = pool.stream_stats()
                copies = {k: after[k] - before[k] for k in COPY_FIELDS}
            copies["minor_faults"] = minor_faults() - faults
            record = forward_record(forward_batch, streamed, time.perf_counter() - wall,
                                    time.thread_time() - cpu, copies)
            record["end_unix"] = time.time()  # to place it beside SGLang's request times
            append_line(path, record)

        return done

    return observe


def forward_record(forward_batch: Any, streamed: bool, wall_s: float, cpu_s: float,
                   copies: dict) -> dict:
    """One forward: its mode, tokens, wall and thread CPU time, and for a streamed pool the
    thread CPU time of the layer copies within it and the rows (token-layers) they loaded from
    and wrote through to the store; the thread's minor page faults in it, and in how many runs
    of consecutive slots its new tokens' KV was written (`slot_runs`: 1 when contiguous,
    `new_tokens` when no two are adjacent)."""
    seq = forward_batch.seq_lens_cpu
    loc = forward_batch.out_cache_loc
    slot_runs = int((loc[1:] - loc[:-1] != 1).sum()) + 1 if loc.numel() else 0
    return {"mode": forward_batch.forward_mode.name, "bs": int(forward_batch.batch_size),
            "new_tokens": int(loc.numel()),
            "seq_tokens": int(seq.sum()) if seq is not None else None, "streamed": streamed,
            "wall_ms": wall_s * 1e3, "cpu_ms": cpu_s * 1e3,
            "copy_ms": copies.get("copy_s", 0.0) * 1e3,
            "rows_loaded": copies.get("rows_loaded", 0),
            "rows_saved": copies.get("rows_saved", 0),
            "minor_faults": copies.get("minor_faults", 0), "slot_runs": slot_runs}


def reclaim_split():
    """The `reclaim_fence` point: a ThreadSpan from the fence's start to its acknowledgement."""
    span = ThreadSpan()
    return lambda: span.split().describe()


class StepTimer:
    """The `step` point with the `forward` point: each loop iteration that ran a forward is
    appended as {"step_ms", "forward_ms", "forwards"} once the next iteration begins (the write
    falls outside both); `inner` is another forward observer to chain (the forward trace).
    Scheduler thread only."""

    def __init__(self, path: str, inner: Any = None):
        self.path, self.inner = path, inner
        self._start: float | None = None
        self._forward_s = 0.0
        self._forwards = 0

    def mark(self) -> None:
        now = time.perf_counter()
        if self._start is not None and self._forwards:
            append_line(self.path, {"step_ms": (now - self._start) * 1e3,
                                    "forward_ms": self._forward_s * 1e3,
                                    "forwards": self._forwards})
        self._start, self._forward_s, self._forwards = time.perf_counter(), 0.0, 0

    def forward(self, runner: Any, forward_batch: Any):
        t0 = time.perf_counter()
        inner_done = self.inner(runner, forward_batch) if self.inner is not None else None

        def done() -> None:
            if inner_done is not None:
                inner_done()
            self._forward_s += time.perf_counter() - t0
            self._forwards += 1

        return done
