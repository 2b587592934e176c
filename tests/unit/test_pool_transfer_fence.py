"""The copy fence of a pool lease (dataplane/copy_fence.py, PoolTransferEngine.fence): what lets a
borrower acknowledge a reclaim from its control agent's thread while copies run on the copy lane.

Invariants: once `fence(blocks)` returns, no copy touches those blocks (the layer in flight was
waited out, no later layer runs) and every copy begun later that touches them is refused without
moving a byte; copies on other blocks are unaffected.
"""

from __future__ import annotations

import threading

import torch
from unit.copy_helpers import hold_in_layer

from sglang_swift.dataplane import CpuLayerCounter
from sglang_swift.dataplane.copy_fence import CopyFence
from tests.unit.test_pool_transfer import POISON, Lease, poisoned_like, same


def _stored(lease: Lease, nblocks: int):
    """An engine whose lease blocks 0 .. nblocks-1 hold a stored prefix; (engine, slots)."""
    P = lease.g.page_size
    slots = lease.slots(nblocks * P, True, 1)
    engine = lease.engine()
    assert engine.begin_store(slots, torch.arange(nblocks)).wait(30).ok
    return engine, slots


def test_fence_waits_out_the_layer_in_flight_and_no_later_layer_runs():
    """Race: a load is copying layer 1 when the fence lands on another thread. The fence returns
    only after that layer finished, and no further layer starts (the rest fail)."""
    lease = Lease("layers")
    P, n = lease.g.page_size, lease.g.num_layers
    nblocks = min(lease.packing.num_blocks, 4)
    _, slots = _stored(lease, nblocks)
    k2, v2 = poisoned_like(lease.k), poisoned_like(lease.v)
    engine = lease.engine(k2, v2)
    log = []
    inside, go = hold_in_layer(engine, 1, log)  # layer 1 reads donor pages until `go`
    counter = CpuLayerCounter(n, timeout_s=30)
    handle = engine.begin_load(lease.slots(nblocks * P, True, 2), torch.arange(nblocks), counter)
    fencer = threading.Thread(target=lambda: (engine.fence([nblocks - 1]),
                                              log.append(("fenced", None))))
    try:
        assert inside.wait(10)
        fencer.start()
        fencer.join(0.5)
        assert fencer.is_alive(), "the fence returned while layer 1 still read the blocks"
        log.append(("go", None))
    finally:
        go.set()
    fencer.join(30)
    assert log == [("start", 0), ("end", 0), ("start", 1), ("go", None), ("end", 1),
                   ("fenced", None)]
    result = handle.wait(30)
    assert not result.ok and set(range(2, n)) <= set(result.failed_layers)
    for layer in range(2, n):  # never written
        assert bool((k2[layer].view(torch.uint8) == POISON).all())
    assert engine.copy_fence.live() == 0
    engine.close()


def test_copies_begun_after_a_fence_are_refused_and_move_nothing():
    """A store or a load touching a fenced block is refused at begin (failed handle, failed
    counter layers, no byte moved); one on other blocks of the same lease still runs."""
    lease = Lease("layers")
    P, n = lease.g.page_size, lease.g.num_layers
    engine, slots = _stored(lease, 4)
    assert engine.fence([2]) == 0  # nothing in flight
    assert engine.fenced([2, 3]) and not engine.fenced([0, 1])
    region = lease.region.clone()
    store = engine.begin_store(lease.slots(2 * P, True, 3), [1, 2]).wait(30)
    assert not store.ok and store.reason.startswith("blocks fenced")
    assert same(lease.region, region)
    k2, v2 = poisoned_like(lease.k), poisoned_like(lease.v)
    loader = lease.engine(k2, v2)
    loader.copy_fence = engine.copy_fence  # one lease, one fence
    counter = CpuLayerCounter(n, timeout_s=30)
    load = loader.begin_load(lease.slots(2 * P, True, 4), [2, 3], counter)
    assert not load.wait(30).ok and counter.failed_layers(load.producer_id) == tuple(range(n))
    assert all(bool((t.view(torch.uint8) == POISON).all()) for t in k2 + v2)
    dst = lease.slots(2 * P, True, 5)
    assert loader.begin_load(dst, [0, 1], CpuLayerCounter(n, timeout_s=30)).wait(30).ok
    assert same(k2[0][dst], lease.k[0][slots[: 2 * P]])
    engine.close()
    loader.close()


def test_no_copy_touches_fenced_blocks_after_the_fence_returns_under_concurrent_begins():
    """Race: one thread begins stores on the fenced block in a loop while another fences.
    Every store is either refused or stopped; none copies a layer after `fence` returned."""
    lease = Lease("layers")
    P = lease.g.page_size
    engine = lease.engine()
    fenced_at, late = threading.Event(), []
    real_copy = engine._copy_layer

    def watched_copy(plan, layer, store, staging):
        if fenced_at.is_set():
            late.append(layer)
        return real_copy(plan, layer, store, staging)

    engine._copy_layer = watched_copy
    handles, stop = [], threading.Event()

    def begin_stores():
        while not stop.is_set() and len(handles) < 2000:
            handles.append(engine.begin_store(lease.slots(P, True, len(handles)), [0]))

    starter = threading.Thread(target=begin_stores)
    starter.start()
    while len(handles) < 20 and starter.is_alive():
        threading.Event().wait(0.001)
    engine.fence([0])
    fenced_at.set()
    stop.set()
    starter.join(30)
    results = [h.wait(30) for h in handles]
    assert late == [], f"layers copied after the fence returned: {late}"
    assert any(not r.ok for r in results)
    assert engine.copy_fence.live() == 0
    engine.close()


def test_copy_fence_books():
    """admit refuses exactly the copies touching a fenced block; fence returns exactly the live
    copies touching its blocks; retire forgets a copy."""
    fence = CopyFence()
    assert fence.admit("a", [1, 2]) and fence.admit("b", [3])
    assert fence.fence([2, 9]) == ["a"]
    assert not fence.admit("c", [9]) and fence.admit("d", [4])
    fence.retire("a")
    assert fence.fence([1, 3]) == ["b"] and fence.live() == 2
    assert fence.touches([3]) and not fence.touches([4])
