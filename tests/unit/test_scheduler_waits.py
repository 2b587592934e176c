"""The scheduler thread never waits long, whatever a copy or a peer does (docs/streaming.md,
"What the scheduler thread waits for"): an eviction's room is free when it returns, however
stuck the copy thread is; a forward stops waiting for a donor load at its batch's deadline; a
copy the forward went past is stopped without waiting for it, and writes nothing afterwards.

The rig is test_streaming's: a real `SwiftRadixCache` over real `PoolTransferEngine`s sharing
one CPU copy lane. "A peer whose copies never finish" is that lane held by a gate: every copy
queued on it (a load) stays unstarted until the test opens it.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from tests.unit.test_streaming import ROWS, G, Rig, gate_lane

# An eviction here stores at most ROWS tokens of G (4 layers, 2 heads of 8, fp32: 512 bytes a
# token, 32 KiB in all): a few milliseconds of copying. The bound asserted is far above that and
# far below STUCK_S, how long the "stuck" copy thread is held when a test does not open it
# itself: code that waits for it fails the bound instead of hanging the test.
EVICT_BOUND_S = 0.5
STUCK_S = 3.0


def stuck_lane(rig):
    """The copy thread held (a copy that does not finish) for STUCK_S at most."""
    gate = gate_lane(rig)
    timer = threading.Timer(STUCK_S, gate.set)
    timer.daemon = True
    timer.start()
    return gate


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def _evict(rig, n):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    t0 = time.perf_counter()
    out = rig.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted
    return out, time.perf_counter() - t0


def _load(rig, tokens, rid):
    """Admit, start, run and settle a donor load of `tokens`; returns the request."""
    req, _, out = rig.admit(tokens, rid)
    assert out is not None and out[0] == len(tokens)
    req.slots = rig.cache.prefix_device_indices(req)
    batch = SimpleNamespace(hicache_consumer_index=-1, reqs=[req])
    rig.cache.swift_batch_built(batch)
    ok = rig.forward(batch, [tokens])
    rig.cache.swift_batch_ran(SimpleNamespace(chunked_req=None), batch)
    return req, ok


def test_an_eviction_frees_its_room_before_returning_while_the_copy_thread_is_stuck(rig):
    """Invariant: with the copy thread stuck behind a copy that does not finish, an eviction
    that must demote returns within EVICT_BOUND_S with every slot it evicted free (nothing left
    leaving or in flight), and the prefix is a donor hit whose bytes are exactly its KV."""
    tokens = list(range(1, 33))
    slots = rig.prefix(tokens)
    rig.prefix(list(range(300, 300 + ROWS - 32)))  # the pool is full
    gate = stuck_lane(rig)
    evicted, took = _evict(rig, ROWS)
    assert evicted == ROWS and took < EVICT_BOUND_S, took
    assert rig.alloc.available_size() == ROWS and set(slots.tolist()) <= set(rig.alloc.free_slots)
    assert rig.cache.tree.leaving_size() == 0 and rig.cache.protected_size() == 0
    stats = rig.runtime.stats
    assert stats["stored_tokens"] == ROWS and stats["evict_store_max_s"] <= took
    m = rig.match(tokens)
    assert (m.device_prefix_len, m.host_hit_length) == (0, 32)
    rig.poison()  # the freed slots are rewritten at once, as the next forward would
    gate.set()
    req, ok = _load(rig, tokens, "r")
    assert all(ok) and req.discard_output_reason is None and rig.kv_of(req, tokens)
    rig.lane.submit(lambda: None).result()
    rig.cache.swift_step()
    rig.cache.check_integrity()


def test_a_store_that_stops_midway_drops_its_prefix_and_claims_no_donor_block(rig):
    """Invariant: a demotion whose donor is lost after two layers still frees its slots before
    the eviction returns; the prefix is gone from every tier (recomputed when asked again), the
    lease's blocks are all free, and no match offers bytes that were not written."""
    from radix_ext import DONOR

    tokens = list(range(1, 9))
    slots = rig.prefix(tokens)
    seen = {"n": 0}

    def alive():  # asked once before each layer of the store
        seen["n"] += 1
        return seen["n"] <= 2

    rig.runtime.engines[("d", 0)].liveness = alive
    capacity = rig.cache.tree.donor.capacity_tokens()
    evicted, took = _evict(rig, 8)
    assert evicted == 8 and took < EVICT_BOUND_S
    assert set(slots.tolist()) <= set(rig.alloc.free_slots)
    assert rig.cache.tree.match(tokens).tokens_from(DONOR) == 0
    assert rig.cache.tree.donor.available_tokens() == capacity
    assert rig.runtime.stats["refused_stores"] == 1 and rig.runtime.stats["stored_tokens"] == 0
    assert rig.match(tokens).host_hit_length == 0
    rig.cache.check_integrity()


def test_idle_steps_evict_nothing_so_the_device_keeps_all_it_has_room_for(rig):
    """Invariant: with no eviction asked for, scheduler steps demote nothing (no headroom is kept
    free ahead of need): a full pool stays full of cached prefixes, all device hits."""
    tokens = list(range(1, ROWS + 1))
    rig.prefix(tokens)
    for _ in range(3):
        rig.cache.swift_step()
    assert rig.alloc.available_size() == 0 and rig.cache.evictable_size() == ROWS
    assert rig.match(tokens).device_prefix_len == ROWS
    assert rig.runtime.stats["stores_started"] == 0


def test_a_load_whose_copy_never_starts_ends_the_forward_wait_at_the_batch_deadline(rig):
    """Invariant: a donor load whose copy never runs (the copy thread stuck) holds the forward
    only until its batch's deadline (wait_budget after the batch started): every layer then
    reports failed, settling the batch does not wait for the copy, the request is aborted (503,
    never inserted), and when the copy thread finally runs, the aborted copy writes nothing into
    the slots that were the request's."""
    import sglang.srt.managers.schedule_batch  # noqa: F401 - imported by the server long before

    tokens = list(range(1, 17))
    rig.prefix(tokens)
    rig.demote_all()
    budget = 0.3
    rig.cache.donor_hits.loads.wait_budget = lambda n: budget
    gate = stuck_lane(rig)
    req, _, out = rig.admit(tokens, "r")
    assert out[0] == 16
    req.slots = rig.cache.prefix_device_indices(req)
    batch = SimpleNamespace(hicache_consumer_index=-1, reqs=[req])
    t0 = time.perf_counter()
    rig.cache.swift_batch_built(batch)
    ok = rig.forward(batch, [tokens])
    waited = time.perf_counter() - t0
    assert ok == [False] * G.num_layers and budget - 0.05 <= waited < budget + 0.5, waited
    t1 = time.perf_counter()
    rig.cache.swift_batch_ran(SimpleNamespace(chunked_req=None), batch)
    assert time.perf_counter() - t1 < 0.2, "settling waited for a copy that never started"
    assert req.skip_radix_cache_insert and req.discard_output_reason is not None
    assert req.discard_output_reason.status_code == 503
    rig.poison()  # SGLang frees the request's slots; whoever gets them writes them
    gate.set()
    rig.lane.submit(lambda: None).result()
    assert all(float(t[s].abs().max()) == 7777.0 for t in (*rig.k, *rig.v)
               for s in req.slots.tolist()), "an aborted load wrote into freed slots"
    rig.cache.swift_step()
    assert rig.cache.tree.in_flight() == 0
    rig.cache.check_integrity()


def test_a_late_load_within_its_deadline_is_waited_for_and_read_complete(rig):
    """Invariant: the deadline does not cut a copy that is merely late: a load that starts
    100 ms into its batch, with a 2 s budget, is read complete and the request keeps its KV."""
    tokens = list(range(1, 17))
    rig.prefix(tokens)
    rig.demote_all()
    rig.poison()
    rig.cache.donor_hits.loads.wait_budget = lambda n: 2.0
    gate = gate_lane(rig)
    req, _, out = rig.admit(tokens, "r")
    req.slots = rig.cache.prefix_device_indices(req)
    batch = SimpleNamespace(hicache_consumer_index=-1, reqs=[req])
    rig.cache.swift_batch_built(batch)
    threading.Timer(0.1, gate.set).start()
    assert all(rig.forward(batch, [tokens])) and rig.kv_of(req, tokens)
    rig.cache.swift_batch_ran(SimpleNamespace(chunked_req=None), batch)
    assert req.discard_output_reason is None and rig.runtime.stats["loaded_tokens"] == 16


class FakeGpuLane:
    """A copy lane shaped like `streams.CudaLane` (it has a stream; `submit` runs the job at
    once, as enqueueing does) for the GPU branch of `copies.store_now` on a CPU machine."""

    kind = "cuda-stream"

    def __init__(self):
        self.stream = object()
        self.synced = 0

    def submit(self, fn, *args):
        import concurrent.futures as cf

        done = cf.Future()
        done.set_result(fn(*args))  # enqueueing: the job's result is there at once
        return done

    def launch(self, fn):
        fn()  # a kernel launch, run at once here

    def synchronize(self):
        self.synced += 1


def test_a_gpu_store_frees_slots_at_enqueue_orders_the_compute_stream_and_stays_tracked(
        rig, monkeypatch):
    """Invariant (GPU branch, with a fake stream): the eviction returns with the victims' slots
    free once the store is enqueued; before it returns, the compute stream was made to wait on a
    marker recorded after the store (so a forward rewrites the slots only after the copy); the
    copy stays registered with the runtime (a reclaim stops it) until that marker is done, and
    the next scheduler step after that unregisters it."""
    from sglang_swift.dataplane import streams

    marker = SimpleNamespace(done=False)
    ordered = []
    monkeypatch.setattr(streams, "done_marker", lambda lane: marker)
    monkeypatch.setattr(streams, "marker_done", lambda m: m.done)
    monkeypatch.setattr(streams, "wait_event_on_current_stream", ordered.append)
    rig.runtime.engines[("d", 0)].lane = FakeGpuLane()
    tokens = list(range(1, 9))
    slots = rig.prefix(tokens)
    evicted, took = _evict(rig, 8)
    assert evicted == 8 and took < EVICT_BOUND_S
    assert set(slots.tolist()) <= set(rig.alloc.free_slots)
    assert ordered == [marker], "the compute stream does not wait for the store"
    assert len(rig.runtime.tracked) == 1, "a store still on the GPU is not registered"
    assert rig.match(tokens).host_hit_length == 8
    rig.cache.swift_step()
    assert len(rig.runtime.tracked) == 1, "released before its marker completed"
    marker.done = True
    rig.cache.swift_step()
    assert not rig.runtime.tracked
    rig.cache.check_integrity()
