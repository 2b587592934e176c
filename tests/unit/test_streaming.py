"""Donor hits loaded under the forward, and demotions (integration/streaming.py, demotion.py,
layer_fan_in.py, and the cache paths that drive them); the bounds on the scheduler thread's waits
are in test_scheduler_waits.py.

A real `SwiftRadixCache` with a donor tier, real `PoolTransferEngine`s over a donor pool region
laid out by `PoolLayout` (another model shape), and a borrower pool of per-layer K / V tensors;
SGLang's scheduler is played by the test: it matches, calls `init_load_back` as the
`PrefillAdder` does, runs the batch hooks, and "runs the forward" by asking the registered
layer counter for each layer before reading it, as the KV pool's buffer getters do.
"""

from __future__ import annotations

import threading
from array import array
from types import SimpleNamespace

import pytest
import torch

from sglang_swift.dataplane import KVGeometry, LeasePacking, PoolTransferEngine
from sglang_swift.dataplane.layer_counter import CpuLayerCounter
from sglang_swift.dataplane.streams import CpuLane
from sglang_swift.integration.layer_fan_in import BatchLayerCounter
from sglang_swift.integration.reclaim_loss import ReclaimLoss
from tests.unit.test_packing import pool_of

G = KVGeometry(4, 2, 8, 8, "float32", 1)  # the borrower: 4 layers, page 1
DONOR_PAGE = KVGeometry(3, 2, 8, 8, "float16", 4)  # the donor pool's own shape
ROWS = 64


class Allocator:
    """SGLang's token allocator, as the cache uses it (page 1), over a pool of K / V tensors."""

    def __init__(self, kv_pool):
        self.free_slots = list(range(ROWS))
        self.size = ROWS
        self.device = "cpu"
        self.kv_pool = kv_pool

    def available_size(self):
        return len(self.free_slots)

    def alloc(self, n):
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free_segment(self, t, *, start_pos):
        self.free_slots.extend(t.tolist())

    def get_kvcache(self):
        return self.kv_pool


class Runtime:
    """What the cache's streaming asks of `SwiftRuntime`: engines per lease, tracking, stats."""

    def __init__(self, stats_keys):
        self.engines, self.dead, self.tracked = {}, set(), {}
        self.device = torch.device("cpu")
        self.lent_tokens = 0  # a borrower lends nothing
        self.reclaim_loss = ReclaimLoss()  # no reclaim in these tests: nothing lost
        self.stats = {k: 0 for k in ("stored_tokens", "loaded_tokens", "refused_stores",
                                     "refused_loads", *stats_keys)}

    tp = None  # one rank

    def pump(self, due=True):  # control events: none in these tests
        pass

    def lend(self, scheduler=None):  # a borrower lends nothing
        pass

    def watch_loop(self, scheduler):  # one rank: no agent's wake of the scheduler loop
        pass

    def woken(self):
        return False

    @property
    def agent(self):  # the control agent's books: none here
        return SimpleNamespace(check_integrity=lambda: None)

    def lease_engine(self, donor, lease):
        return None if (donor, lease) in self.dead else self.engines.get((donor, lease))

    def readable(self, donor, lease, blocks):  # SwiftRuntime.readable with one rank
        engine = self.lease_engine(donor, lease)
        return engine is not None and engine.liveness() and not engine.fenced(blocks)

    def track(self, key, handle, blocks):
        self.tracked[id(handle)] = (key, blocks)

    def untrack(self, key, handle):
        self.tracked.pop(id(handle), None)


class Rig:
    """A borrower cache with donor leases `leases` (name -> donor pool pages lent)."""

    def __init__(self, leases=("d",), pages=128):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        from radix_ext import TreeConfig
        from sglang_swift.integration.build import build_cache
        from sglang_swift.integration.cache import STREAM_STATS

        self.k = [torch.zeros(ROWS, G.num_kv_heads, G.head_dim) for _ in range(G.num_layers)]
        self.v = [torch.zeros(ROWS, G.num_kv_heads, G.head_dim) for _ in range(G.num_layers)]
        self.registered = []
        pool = SimpleNamespace(k_buffer=self.k, v_buffer=self.v, layer_num=G.num_layers,
                               register_layer_transfer_counter=self.registered.append)
        self.alloc = Allocator(pool)
        self.runtime = Runtime(STREAM_STATS)
        tp_worker = SimpleNamespace(register_hicache_layer_transfer_counter=self.registered.append)
        self.cache = build_cache(
            CacheInitParams(disable=False, req_to_token_pool=None,
                            token_to_kv_pool_allocator=self.alloc, page_size=1),
            TreeConfig(page_size=1, donor=True), tp_worker=tp_worker, runtime=self.runtime)
        self.lane = CpuLane()
        self.gates = []
        self.alive = {}
        for name in leases:
            layout = pool_of(DONOR_PAGE, pages)
            region = torch.zeros(layout.data_bytes, dtype=torch.uint8)
            packing = LeasePacking(G, layout, list(range(pages)))
            self.alive[name] = True
            self.runtime.engines[(name, 0)] = PoolTransferEngine(
                packing, region, self.k, self.v, lane=self.lane,
                liveness=lambda n=name: self.alive[n])
            self.cache.tree.donor.add_lease(name, 0, 1, packing.num_blocks)
        self.counter = self.cache.donor_hits.counter

    def close(self):
        for gate in self.gates:  # a failed test must not leave the lane blocked
            gate.set()
        self.lane.close()

    def prefix(self, tokens):
        """Compute `tokens` into fresh slots (distinct values per token and layer), insert them."""
        slots = self.alloc.alloc(len(tokens))
        for layer in range(G.num_layers):
            for s, t in zip(slots.tolist(), tokens):
                self.k[layer][s] = t * 10 + layer
                self.v[layer][s] = -(t * 10 + layer)
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
        return slots

    def match(self, tokens):
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))

    def admit(self, tokens, rid):
        """What SGLang does for an admitted request with a donor hit; returns (req, result)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        m = self.match(tokens)
        req = SimpleNamespace(rid=rid, last_node=m.last_device_node, prefix_len=m.device_prefix_len,
                              full_untruncated_fill_ids=list(tokens) + [0],  # one new token
                              skip_radix_cache_insert=False, discard_output_reason=None)
        out = self.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length,
                                                           req=req))
        if out:
            req.prefix_len += out[0]
        return req, m, out

    def forward(self, batch, reqs_tokens):
        """Attention over each request's prefix, layer by layer, as the pool's getters wait;
        returns, per layer, whether the counter said the layer was ready."""
        self.counter.set_consumer(batch.hicache_consumer_index)
        ok = [self.counter.wait_until(layer) for layer in range(G.num_layers)]
        self.counter.set_consumer(-1)
        return ok

    def kv_of(self, req, tokens):
        """Whether the request's prefix slots hold exactly `tokens`' KV in every layer."""
        slots = self.cache.prefix_device_indices(req) if not hasattr(req, "slots") else req.slots
        want = torch.tensor(tokens, dtype=torch.float32)
        return all(torch.equal(self.k[layer][slots][:, 0, 0], want * 10 + layer)
                   and torch.equal(self.v[layer][slots][:, 0, 0], -(want * 10 + layer))
                   for layer in range(G.num_layers))

    def demote_all(self):
        """Evict everything on the device into the donor tier (stores settle in the eviction)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size()))
        assert self.cache.tree.leaving_size() == 0

    def poison(self):
        for t in (*self.k, *self.v):
            t.fill_(7777.0)


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def test_donor_hit_is_reported_then_loaded_only_at_batch_start_and_read_layer_by_layer(rig):
    """Invariant: match_prefix reports the donor part as host_hit_length and copies or allocates
    nothing; init_load_back allocates and queues but starts no copy; the batch hook starts it and
    sets the batch's consumer index; each layer the forward reads holds the prefix's KV; after
    the forward the request keeps its slots (it inserts them itself), tickets close, and the
    scheduler never waited for a copy."""
    tokens = list(range(1, 17))
    rig.prefix(tokens)
    rig.demote_all()
    rig.poison()
    waited = (rig.runtime.stats["evict_wait_s"], rig.runtime.stats["evict_waits"])
    free_before = rig.alloc.available_size()
    m = rig.match(tokens)
    assert (m.device_prefix_len, m.host_hit_length) == (0, 16)
    assert rig.alloc.available_size() == free_before and rig.counter.producer_index == -1
    req, _, out = rig.admit(tokens, "r1")
    assert out == (16, rig.cache.root_node)
    assert rig.alloc.available_size() == free_before - 16
    assert rig.counter.producer_index == -1, "a copy started before its batch did"
    assert rig.registered == [rig.counter, rig.counter], "pool and tp worker wait on one counter"
    req.slots = rig.cache.prefix_device_indices(req)  # what prepare_for_extend writes in the row
    batch = SimpleNamespace(hicache_consumer_index=-1, reqs=[req])
    rig.cache.swift_batch_built(batch)
    assert batch.hicache_consumer_index == rig.counter.producer_index >= 0
    assert all(rig.forward(batch, [tokens]))
    assert rig.kv_of(req, tokens)
    rig.cache.swift_batch_ran(SimpleNamespace(chunked_req=None), batch)
    assert req.discard_output_reason is None and not req.skip_radix_cache_insert
    assert batch.hicache_consumer_index == -1, "a decode batch reusing it must not wait"
    rig.lane.submit(lambda: None).result()  # the lane's job has returned
    rig.cache.swift_step()
    assert rig.cache.tree.in_flight() == 0 and not rig.runtime.tracked
    stats = rig.runtime.stats
    assert (stats["loaded_tokens"], stats["loads_started"], stats["loads_failed"]) == (16, 1, 0)
    assert (stats["evict_wait_s"], stats["evict_waits"]) == waited and stats["load_wait_s"] == 0
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    rig.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=req.slots))
    assert rig.match(tokens).device_prefix_len == 16, "the request's insert adopts its slots"
    rig.cache.check_integrity()


def test_a_donor_lost_mid_copy_aborts_only_its_requests_and_never_releases_a_layer_early():
    """Invariant: two requests load from two leases in one batch; one donor dies after two
    layers. Layer l is released to attention only when both copies are past it; the request of
    the dead donor is aborted (output discarded, never inserted); the other reads complete KV."""
    rig = Rig(leases=("a", "b"))
    try:
        ta, tb = list(range(1, 9)), list(range(101, 109))
        rig.prefix(ta)
        rig.demote_all()
        rig.prefix(tb)
        rig.demote_all()
        seen = {"a": 0}

        def alive_a():  # asked once before each layer: the donor is gone from layer 2 on
            seen["a"] += 1
            return seen["a"] <= 2

        rig.runtime.engines[("a", 0)].liveness = alive_a
        ra, ma, oa = rig.admit(ta, "ra")
        rb, mb, ob = rig.admit(tb, "rb")
        by_lease = {ma.best_match_node.res["donor"].donor: (ra, ta),
                    mb.best_match_node.res["donor"].donor: (rb, tb)}
        assert oa[0] == 8 and ob[0] == 8 and set(by_lease) == {"a", "b"}
        for r in (ra, rb):
            r.slots = rig.cache.prefix_device_indices(r)
        batch = SimpleNamespace(hicache_consumer_index=-1, reqs=[ra, rb])
        rig.cache.swift_batch_built(batch)
        # the counter says "nothing writes this layer any more": a failed copy releases its
        # layers too (the forward must not hang), and its requests are dropped afterwards
        assert rig.forward(batch, [ta, tb]) == [True] * G.num_layers
        ok_req, ok_tokens = by_lease["b"]
        assert rig.kv_of(ok_req, ok_tokens), "a layer was released before the healthy copy"
        rig.cache.swift_batch_ran(SimpleNamespace(chunked_req=None), batch)
        bad_req = by_lease["a"][0]
        assert bad_req.skip_radix_cache_insert and bad_req.discard_output_reason is not None
        assert "donor lost" in bad_req.discard_output_reason.message
        assert ok_req.discard_output_reason is None and not ok_req.skip_radix_cache_insert
        assert rig.runtime.stats["loads_failed"] == 1
        rig.lane.submit(lambda: None).result()
        rig.cache.swift_step()
        assert rig.cache.tree.in_flight() == 0
        rig.cache.check_integrity()
    finally:
        rig.close()


def test_a_lease_unreadable_at_match_time_is_not_reported_as_a_hit(rig):
    """Invariant: a donor part on a lease that cannot be read now is not offered to SGLang as a
    lower-tier hit (the request recomputes; nothing is queued)."""
    tokens = list(range(1, 9))
    rig.prefix(tokens)
    rig.demote_all()
    rig.runtime.dead.add(("d", 0))
    m = rig.match(tokens)
    assert (m.device_prefix_len, m.host_hit_length) == (0, 0)


def test_a_lease_dying_between_match_and_admission_is_a_refused_load_and_a_recompute(rig):
    """Invariant: a donor hit whose lease is unreadable when SGLang admits the request is not
    loaded (init_load_back returns no host hit, nothing stays allocated or in flight) and is
    counted as a refused load, apart from loads that failed after they started."""
    tokens = list(range(1, 9))
    rig.prefix(tokens)
    rig.demote_all()
    free_before = rig.alloc.available_size()
    m = rig.match(tokens)
    assert m.host_hit_length == 8
    rig.runtime.dead.add(("d", 0))
    req = SimpleNamespace(rid="r", last_node=m.last_device_node, prefix_len=0,
                          full_untruncated_fill_ids=tokens + [0], skip_radix_cache_insert=False,
                          discard_output_reason=None)
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    out = rig.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length,
                                                      req=req))
    assert out[0] == 0
    assert rig.runtime.stats["refused_loads"] == 1 and rig.runtime.stats["loads_declined"] == 1
    assert rig.cache.tree.in_flight() == 0 and rig.alloc.available_size() == free_before
    rig.cache.check_integrity()


def test_a_lease_dying_between_admission_and_batch_start_aborts_the_request(rig):
    """Invariant: a load queued at admission whose lease is unreadable when its batch starts is
    failed at once (attention does not wait for it) and the request is aborted."""
    tokens = list(range(1, 9))
    rig.prefix(tokens)
    rig.demote_all()
    req, _, out = rig.admit(tokens, "r")
    assert out[0] == 8
    rig.runtime.dead.add(("d", 0))
    req.slots = rig.cache.prefix_device_indices(req)
    batch = SimpleNamespace(hicache_consumer_index=-1, reqs=[req])
    rig.cache.swift_batch_built(batch)
    assert rig.counter.producer_index == batch.hicache_consumer_index
    assert all(rig.forward(batch, [tokens])) and rig.counter.wait_s < 1.0
    rig.cache.swift_batch_ran(SimpleNamespace(chunked_req=req, _pending_chunked_abort_req=None),
                              batch)
    assert req.skip_radix_cache_insert and req.discard_output_reason is not None
    rig.cache.swift_step()
    assert rig.cache.tree.in_flight() == 0
    rig.cache.check_integrity()


def gate_lane(rig):
    """Hold the copy lane: jobs queue behind a gate until it is opened."""
    gate = threading.Event()
    rig.gates.append(gate)
    rig.lane.submit(gate.wait)
    return gate


def test_a_refused_store_is_aborted_not_revoked(rig):
    """Invariant: an eviction whose donor cannot be written now drops the victim (slots freed)
    and leaves the lease whole: no residency claims blocks that were not written."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from radix_ext import DONOR

    tokens = [1, 2, 3]
    slots = rig.prefix(tokens)
    rig.runtime.dead.add(("d", 0))
    capacity = rig.cache.tree.donor.capacity_tokens()
    assert rig.cache.evict(EvictParams(num_tokens=3)).num_tokens_evicted == 3
    assert set(slots.tolist()) <= set(rig.alloc.free_slots)
    assert rig.cache.tree.match(tokens).tokens_from(DONOR) == 0
    assert rig.cache.tree.donor.capacity_tokens() == capacity
    assert rig.cache.tree.donor.available_tokens() == capacity
    assert rig.runtime.stats["refused_stores"] == 1
    rig.cache.check_integrity()


def test_fan_in_releases_a_layer_only_when_every_part_is_past_it():
    """Invariant: with two parts, layer l completes on the pool's counter only after both
    finished or failed l, and only once sealed; a consumer timeout fails every part."""
    counter = CpuLayerCounter(3, timeout_s=0.05)
    fan = BatchLayerCounter(counter)
    a, b = fan.update_producer(), fan.update_producer()
    fan.complete(0, a)
    fan.complete(0, b)
    assert counter.failed_layers(fan.pid) == () and fan.released_at[0] is None, "before seal"
    fan.seal()
    assert fan.released_at[0] is not None
    fan.complete(1, a)
    assert fan.released_at[1] is None
    assert fan.fail("gone", b) == (1, 2)
    assert fan.released_at[1] is not None and fan.released_at[2] is None
    assert fan.failed_parts() == {b: "gone"}
    counter.set_consumer(fan.pid)
    assert counter.wait_until(1) and not counter.wait_until(2)  # times out: part a never did 2
    assert fan.aborted(a) and set(fan.failed_parts()) == {a, b}


def test_the_debug_seam_names_each_request_of_a_batch_load_and_its_start(rig):
    """Invariant: a batch load's facts say which requests it served, how (load or exchange) and
    how many tokens each, and when the batch started in Unix time (per-request timelines join
    them with SGLang's own request times)."""
    import time

    from sglang_swift.integration import debug_seam

    seen = []
    debug_seam.OBSERVERS.batch_load = seen.append
    try:
        tokens = list(range(1, 17))
        rig.prefix(tokens)
        rig.demote_all()
        rig.match(tokens)
        req, _, _ = rig.admit(tokens, "r1")
        req.slots = rig.cache.prefix_device_indices(req)
        batch = SimpleNamespace(hicache_consumer_index=-1, reqs=[req])
        before = time.time()
        rig.cache.swift_batch_built(batch)
        assert all(rig.forward(batch, [tokens]))
        rig.cache.swift_batch_ran(SimpleNamespace(chunked_req=None), batch)
    finally:
        debug_seam.reset()
    assert len(seen) == 1
    assert seen[0]["loads"] == [{"rid": "r1", "tokens": 16, "kind": "load"}]
    assert before - 0.01 <= seen[0]["t0"] <= time.time()
