"""Where a borrower's reclaim fence spends its time (`ThreadSpan`, the benchmarks' instrument on
the debug seam's reclaim point; `Borrowing.fence`'s
steps), so a slow acknowledgement in a live run says which step or which wait it was.

Invariants: a span splits the thread's wall time into CPU, runnable-but-waiting and blocked
(wall = the three, up to clock granularity); a collection run meanwhile is counted by
generation; a thread waiting for the GIL another thread holds shows as blocked, not as CPU;
`Borrowing.fence` records its blocks, the time to find them and to fence their copies."""

from __future__ import annotations

import gc
import threading
import time
from types import SimpleNamespace as NS

from benchmarks.instruments.thread_span import ThreadSpan
from sglang_swift.control import LeaseKey, ReclaimRequested
from sglang_swift.dataplane.borrowing import Borrowing, FenceSteps


def test_a_span_splits_wall_time_and_counts_collections():
    span = ThreadSpan()
    end = time.thread_time() + 0.02
    while time.thread_time() < end:  # 20 ms on a CPU
        pass
    time.sleep(0.03)  # 30 ms blocked
    gc.collect()
    split = span.split()
    assert split.cpu_ms >= 19
    assert split.blocked_ms >= 25 and split.blocked_times >= 1
    total = split.cpu_ms + split.runnable_ms + split.blocked_ms
    assert abs(total - split.wall_ms) < 1.0
    assert split.collections[2] >= 1
    text = split.describe()
    assert "on a CPU" in text and "gen0/1/2" in text


def test_waiting_for_the_gil_shows_as_blocked_not_cpu():
    """Another thread runs C code that never lets the GIL go (a big `sum(range())`): the
    measured thread is off the CPU meanwhile, which the split tells apart from work."""
    started = threading.Event()

    def hog():
        started.set()
        sum(range(30_000_000))  # holds the GIL throughout

    span = ThreadSpan()
    t = threading.Thread(target=hog)
    t.start()
    started.wait()
    time.sleep(0.001)  # let go of the GIL: the hog takes it; getting it back waits for the sum
    split = span.split()
    t.join()
    assert split.wall_ms > 20, "the hog finished too fast to show anything"
    assert split.cpu_ms < 0.3 * split.wall_ms
    assert split.blocked_ms + split.runnable_ms > 0.7 * split.wall_ms


def test_borrowing_fence_records_its_steps():
    key = LeaseKey("donor", 1, 3)
    calls = []
    packing = NS(blocks_touching=lambda pages, strict: [0, 1, 2])
    engine = NS(fence=lambda blocks: calls.append(list(blocks)) or 2)
    b = Borrowing.__new__(Borrowing)
    b.leases = {("donor", 3): NS(packing=packing, engine=engine)}
    assert b.last_fence is None
    assert b.fence(ReclaimRequested(key, 1, (10, 11), 0.0))
    steps = b.last_fence
    assert isinstance(steps, FenceSteps) and calls == [[0, 1, 2]]
    assert (steps.blocks, steps.aborted) == (3, 2)
    assert steps.blocks_ms >= 0 and steps.copies_ms >= 0
    assert not b.fence(ReclaimRequested(LeaseKey("donor", 1, 4), 1, (1,), 0.0))
