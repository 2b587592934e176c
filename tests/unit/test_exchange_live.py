"""A donor hit swapped with device victims (donor_hits.py `_exchange`, radix_ext/exchange.py,
`admission.should_exchange`): begun in the tree at `init_load_back`, copied layer by layer under
the request's forward (streaming.py `queue_exchange`, `PoolTransferEngine.begin_exchange` with the
batch's layer counter), settled after it. On test_streaming's rig: a real `SwiftRadixCache`, real
`PoolTransferEngine`s over a donor pool region, per-layer K / V tensors as the borrower's pool.

The scene: the donor tier is full of demoted prefixes A, B, C; the device holds other prefixes
D0, D1, ... (inserted in that order, so D0 is the least recently used) with FREE slots left.
A request for A (plus one new token) needs 10 slots: 8 for A, 1 new, 1 page of headroom.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
import torch

from radix_ext import DONOR, admission
from tests.unit.test_streaming import ROWS, G, Rig

A, B, C = (list(range(100 * i + 1, 100 * i + 9)) for i in (1, 2, 3))
NEED = len(A) + 1 + 1  # the hit, one new token, one page
# D0 is shorter than A, so the victims are D0 and the tail of D1 (split off)
SIZES = (6, 8, 8, 8, 8, 8, 8, 8)
FREE = ROWS - sum(SIZES)  # 2: room for the new tokens, none for the hit
POISON = 7777.0


def device_prefixes(sizes):
    return [list(range(1000 + 100 * i, 1000 + 100 * i + n)) for i, n in enumerate(sizes)]


def scene(pages=16, donor=(A, B, C), sizes=SIZES):
    """The rig with `donor` demoted (pages=16: 24 donor tokens, full with A, B, C) and the
    device holding prefixes of `sizes`; returns (rig, device prefixes, their slots)."""
    rig = Rig(pages=pages)
    for p in donor:
        rig.prefix(p)
    rig.demote_all()
    ds = device_prefixes(sizes)
    slots = [rig.prefix(d) for d in ds]
    assert rig.alloc.available_size() == ROWS - sum(sizes)
    return rig, ds, slots


def where(rig, tokens):
    """(device tokens, donor tokens SGLang is offered) of a match of `tokens`."""
    m = rig.match(tokens)
    return m.device_prefix_len, m.host_hit_length


def load_back(rig, tokens, rid, m=None):
    """SGLang's admission of a request for `tokens` plus one new token: match (unless given),
    init_load_back, and what the PrefillAdder does with the answer (prefix length, last node;
    the request's lock on it, which the test releases). Returns (req, match, out, owned)."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    m = rig.match(tokens) if m is None else m
    req = SimpleNamespace(rid=rid, last_node=m.last_device_node, prefix_len=m.device_prefix_len,
                          full_untruncated_fill_ids=list(tokens) + [0],
                          skip_radix_cache_insert=False, discard_output_reason=None)
    out = rig.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length,
                                                      req=req))
    owned = rig.cache.load_back_is_cache_owned()
    req.prefix_len += out[0]
    req.last_node = out[1]
    # what the PrefillAdder commits: the lock on the request's node, the tree-owned part of its row
    req.kv = SimpleNamespace(cache_protected_len=req.prefix_len if owned else m.device_prefix_len)
    req.lock = rig.cache.lock(req.last_node)
    return req, m, out, owned


def release(rig, req):
    """SGLang's release of the request's row (release_kv_cache): the slots past the tree-owned
    part are freed (an aborted request's only: a kept one inserted them), the lock given back."""
    if req.skip_radix_cache_insert:
        rig.alloc.free_segment(req.slots[req.kv.cache_protected_len:], start_pos=0)
    rig.cache.unlock(req.lock)
    req.lock = None


def run_batch(rig, req, forward=None):
    """The request's batch: hooks and a forward reading every layer (`forward(batch)` instead
    when given); returns the layers' ok."""
    req.slots = rig.cache.prefix_device_indices(req)
    batch = SimpleNamespace(hicache_consumer_index=-1, reqs=[req])
    rig.cache.swift_batch_built(batch)
    ok = (forward or (lambda b: rig.forward(b, None)))(batch)
    rig.cache.swift_batch_ran(SimpleNamespace(chunked_req=None), batch)
    rig.lane.submit(lambda: None).result()
    rig.cache.swift_step()
    return ok


def hold_exchanges(rig, monkeypatch, before_layer):
    """Run `before_layer(l)` on the lane before each layer of every exchange (the engine's test
    hook)."""
    engine = rig.runtime.engines[("d", 0)]
    begin = engine.begin_exchange
    monkeypatch.setattr(engine, "begin_exchange",
                        lambda *a, **k: begin(*a, before_layer=before_layer, **k))


def rows(rig, layer, slots):
    """Layer `layer`'s K values (one per slot) as token ids (K = token * 10 + layer)."""
    return ((rig.k[layer][slots][:, 0, 0] - layer) / 10).tolist()


def poison_free(rig):
    """Free slots hold garbage, as after other requests used them."""
    free = torch.tensor(rig.alloc.free_slots, dtype=torch.int64)
    for t in (*rig.k, *rig.v):
        t[free] = POISON


def accounted(rig):
    """SGLang's idle check: with nothing locked every slot is free, evictable or protected."""
    c = rig.cache
    return rig.alloc.available_size() + c.evictable_size() + c.protected_size() == ROWS


def admit_a(rig):
    """Admit the request for A; returns (req, match, out, owned)."""
    return load_back(rig, A, "ra")


def test_a_hit_that_would_push_donor_prefixes_out_is_swapped_with_the_lru_victims():
    """Invariant: with the donor tier full, A's hit is swapped in place with the device's least
    recently used prefixes (D0 and D1's tail): init_load_back returns (8, A's node), the cache
    owns the hit and A's slots are the victims' former slots, but nothing is copied yet: the
    swap is queued, runs under the request's forward (no streamed load, no slot allocated) and
    settles after it. Meanwhile no other request reaches either side (a match of A, D0 or D1
    ends before them). Afterwards A's slots hold A's KV, the donor tier lost nothing (B, C still
    hits, 24 of 24 tokens used) and the victims are donor hits whose bytes, loaded back through
    the streaming path, are exactly their KV."""
    rig, ds, slots = scene()
    try:
        stats = rig.runtime.stats
        donor_before = rig.cache.tree.tier_size(DONOR)
        assert rig.cache.tree.donor.available_tokens() == 0 and donor_before == 24
        req, m, out, owned = admit_a(rig)
        assert owned and out == (8, m.best_match_node)
        victim_slots = torch.cat([slots[0], slots[1][6:]])
        assert torch.equal(rig.cache.prefix_device_indices(req), victim_slots)
        assert rows(rig, 0, victim_slots) == ds[0] + ds[1][6:], "copied before its batch ran"
        assert rig.cache.tree.exchanges_in_flight() == 1 and stats["exchanges"] == 0
        assert where(rig, A) == (0, 0) and where(rig, ds[0]) == (0, 0)
        assert where(rig, ds[1]) == (6, 0), "a side of the exchange in flight was matched"
        assert where(rig, B) == where(rig, C) == (0, 8)
        assert all(where(rig, d) == (8, 0) for d in ds[2:])
        assert rig.alloc.available_size() == FREE
        rig.cache.check_integrity()
        started = stats["loads_started"]
        assert all(run_batch(rig, req)) and rig.kv_of(req, A)
        assert (stats["exchanges"], stats["exchanged_tokens"], stats["exchanges_failed"]) == (
            1, 8, 0)
        assert stats["loads_started"] == started and stats["loaded_tokens"] == 0
        assert req.discard_output_reason is None and not req.skip_radix_cache_insert
        assert rig.cache.tree.exchanges_in_flight() == 0
        # nothing else moved: B, C stay donor hits, the victims became donor hits, D1's head and
        # the other device prefixes stay on the device; no slot was allocated for the hit
        assert where(rig, A) == (8, 0) and rig.match(A).last_device_node is out[1]
        assert where(rig, B) == where(rig, C) == (0, 8)
        assert where(rig, ds[0]) == (0, 6) and where(rig, ds[1]) == (6, 2)
        assert all(where(rig, d) == (8, 0) for d in ds[2:])
        assert rig.cache.tree.tier_size(DONOR) == donor_before
        assert rig.cache.tree.donor.available_tokens() == 0
        assert rig.alloc.available_size() == FREE
        release(rig, req)
        assert accounted(rig)
        rig.cache.check_integrity()
        _load_the_donor_tier_back(rig, ds)
    finally:
        rig.close()


def test_an_exchanged_hit_streams_layer_by_layer_while_the_scheduler_goes_on(monkeypatch):
    """Invariant: the exchange no longer runs on the scheduler thread: init_load_back and the
    batch start return while the lane's swap is held before its first layer (nothing swapped
    yet, layer 0 not released); attention on layer l waits for layer l only: when the counter
    releases it, layer l of the hit's slots holds A's KV while layer l + 1 still holds the
    victims' (its swap not started); after the forward the request keeps its KV and the victims'
    bytes are in the hit's old blocks."""
    import threading

    gates = [threading.Event() for _ in range(G.num_layers)]
    reached = []

    def before_layer(layer):
        reached.append(layer)
        assert gates[layer].wait(60), "the test never opened the layer"

    rig, ds, slots = scene()
    rig.gates.extend(gates)
    hold_exchanges(rig, monkeypatch, before_layer)
    try:
        victims = ds[0] + ds[1][6:]
        victim_slots = torch.cat([slots[0], slots[1][6:]])
        req, _, out, owned = admit_a(rig)
        assert owned and out[0] == 8

        def forward(batch):
            deadline = time.monotonic() + 30
            while not reached and time.monotonic() < deadline:
                time.sleep(0.001)
            assert reached == [0], "the swap did not start on the lane at batch start"
            assert rows(rig, 0, victim_slots) == victims, "swapped before its layer was opened"
            rig.counter.set_consumer(batch.hicache_consumer_index)
            ok = []
            for layer in range(G.num_layers):
                gates[layer].set()
                ok.append(rig.counter.wait_until(layer))
                assert rows(rig, layer, victim_slots) == A, f"layer {layer} read before its swap"
                if layer + 1 < G.num_layers:
                    assert rows(rig, layer + 1, victim_slots) == victims, (
                        f"layer {layer + 1} swapped before it was opened")
            rig.counter.set_consumer(-1)
            return ok

        assert all(run_batch(rig, req, forward)) and rig.kv_of(req, A)
        assert req.discard_output_reason is None and rig.runtime.stats["exchanges"] == 1
        assert rig.runtime.stats["load_wait_s"] == 0, "the scheduler waited on the swap"
        release(rig, req)
        rig.cache.check_integrity()
        _load_the_donor_tier_back(rig, ds)
    finally:
        rig.close()


def _load_the_donor_tier_back(rig, ds):
    """Make device room without losing a donor prefix (the room's victims are dropped: the
    donor tier is full and its prefixes are held, D1's head is locked), then load each donor
    prefix through the streaming path into poisoned slots and check its bytes."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    tree = rig.cache.tree
    head = rig.match(ds[1]).last_device_node
    with ExitStack() as held:
        for p in (B, C, ds[0], ds[1]):
            held.enter_context(admission.holding(tree.match(p)))
        rig.cache.inc_lock_ref(head)
        rig.cache.evict(EvictParams(num_tokens=rig.cache.evictable_size()))
        rig.cache.dec_lock_ref(head)
    assert where(rig, ds[1]) == (6, 2) and where(rig, ds[0]) == (0, 6)
    assert where(rig, B) == where(rig, C) == (0, 8)
    poison_free(rig)
    stats = rig.runtime.stats
    for i, tokens in enumerate((ds[0], ds[1], B, C)):
        dev, hit = where(rig, tokens)
        req, _, out, owned = load_back(rig, tokens, f"back{i}")
        assert out == (hit, req.last_node) and not owned, "room was free: a plain load"
        assert all(run_batch(rig, req)) and req.discard_output_reason is None
        assert rig.kv_of(req, tokens), f"donor bytes of {tokens[:1]}... are not its KV"
    assert stats["loads_started"] == 4 and stats["exchanges"] == 1
    assert stats["loaded_tokens"] == 6 + 2 + 8 + 8
    rig.cache.check_integrity()


def test_without_the_exchange_the_same_hit_pushes_other_prefixes_out_of_the_donor_tier(
        monkeypatch):
    """What the exchange buys: with `should_exchange` off (the old behaviour), the room for A
    is made by demoting D0 and D1 into the full donor tier, which drops B or C from it (A is
    held); A is loaded by the streaming path."""
    monkeypatch.setattr(admission, "should_exchange", lambda *a, **k: False)
    rig, ds, _ = scene()
    try:
        req, _, out, owned = admit_a(rig)
        assert out == (8, req.last_node) and not owned
        assert rig.runtime.stats["exchanges"] == 0
        lost = [p for p in (B, C) if where(rig, p) != (0, 8)]
        assert lost, "the demotions for A's room pushed nothing out of the full donor tier"
        assert all(run_batch(rig, req)) and rig.kv_of(req, A)
        assert rig.runtime.stats["loads_started"] == 1
        rig.cache.check_integrity()
    finally:
        rig.close()


@pytest.mark.parametrize("pages,donor,sizes,exchanged", [
    (32, (A, B, C), SIZES, False),  # 24 donor tokens free, the room needs 8
    # 4 donor tokens free; the LRU victim D0 has 4 tokens (eviction takes whole leaves)
    (16, (A, B, C[:4]), (4,) + SIZES[1:-1] + (6,), False),  # room 10 - 6 = 4: exactly enough
    (16, (A, B, C[:4]), (4,) + SIZES[1:-1] + (7,), True),  # room 10 - 5 = 5: one short
])
def test_a_donor_tier_with_room_for_the_victims_loads_the_hit_as_usual(pages, donor, sizes,
                                                                       exchanged):
    """Invariant: while the donor tier's free room covers the device room the hit needs, the
    victims are demoted into it (nothing is pushed out) and the hit is streamed under its
    batch's forward; one token short of that, the hit is exchanged."""
    rig, ds, _ = scene(pages, donor, sizes)
    try:
        stats = rig.runtime.stats
        room = NEED - rig.alloc.available_size()
        assert (rig.cache.tree.donor.available_tokens() < room) is exchanged
        req, m, out, owned = admit_a(rig)
        assert rig.cache.tree.exchanges_in_flight() == int(exchanged) and owned is exchanged
        assert out == (8, m.best_match_node if exchanged else rig.cache.root_node)
        assert all(run_batch(rig, req)) and rig.kv_of(req, A)
        assert stats["exchanges"] == int(exchanged)
        assert stats["loads_started"] == int(not exchanged)
        assert all(where(rig, p) == (0, len(p)) for p in donor[1:]), "a donor prefix was lost"
        assert where(rig, ds[0]) == (0, len(ds[0]))
        rig.cache.check_integrity()
    finally:
        rig.close()


def test_a_donor_dead_before_admission_neither_exchanges_nor_loads():
    """Invariant: a hit whose donor is gone when the request is admitted (matched while alive)
    is recomputed: no exchange (failed or not), no load queued or started, nothing left
    allocated, locked or in flight, and SGLang's accounting holds."""
    rig, ds, _ = scene()
    try:
        m = rig.match(A)
        assert m.host_hit_length == 8
        rig.alive["d"] = False
        req, _, out, owned = load_back(rig, A, "ra", m)
        stats = rig.runtime.stats
        assert out == (0, rig.cache.root_node) and not owned
        assert (stats["exchanges"], stats["exchanges_failed"]) == (0, 0)
        assert stats["loads_declined"] == 1
        run_batch(rig, req)
        assert stats["loads_started"] == 0 and stats["loaded_tokens"] == 0
        assert rig.cache.tree.in_flight() == 0 and accounted(rig)
        rig.cache.check_integrity()
    finally:
        rig.close()


@pytest.mark.parametrize("fault", ["donor lost", "fenced", "fenced and revoked"])
def test_an_exchange_that_fails_midway_aborts_its_request_and_drops_both_sides(fault,
                                                                              monkeypatch):
    """Invariant: the swap under the forward stops after two layers (the donor dies, or a reclaim
    fences A's blocks while the lane holds before layer 2, its tree side revoking them too, as
    the runtime does before the settle): attention is not left waiting, the request is aborted
    after the forward (503, never inserted), and neither A's device copy nor the victims' donor
    copy (half swapped) stays in the tree; A's blocks are free (revoked: gone from the lease),
    the other prefixes are untouched, the request's lock moved to A's device parent and the hit's
    slots are its own, freed with it; the tree is consistent and SGLang's accounting holds."""
    import threading

    rig, ds, slots = scene()
    engine = rig.runtime.engines[("d", 0)]
    held, go = threading.Event(), threading.Event()
    rig.gates.append(go)

    def before_layer(layer):
        if layer == 2:
            if fault == "donor lost":
                rig.alive["d"] = False
            else:
                held.set()
                assert go.wait(60)

    hold_exchanges(rig, monkeypatch, before_layer)
    try:
        tree = rig.cache.tree
        a_blocks = [b for seg in tree.match(A).loads for b in seg.source.blocks]
        req, _, out, owned = admit_a(rig)
        assert owned and out[0] == 8

        def forward(batch):
            if fault != "donor lost":
                assert held.wait(30)
                assert engine.fence(a_blocks) == 1, "the swap in flight was not aborted"
                if fault == "fenced and revoked":
                    tree.revoke("d", 0, a_blocks)
                    rig.cache.check_integrity()
                go.set()
            return rig.forward(batch, None)

        run_batch(rig, req, forward)
        stats = rig.runtime.stats
        assert req.skip_radix_cache_insert and req.discard_output_reason is not None
        assert (stats["exchanges"], stats["exchanges_failed"], stats["loads_failed"]) == (0, 1, 1)
        victims = torch.cat([slots[0], slots[1][6:]])
        assert rows(rig, 1, victims) == A and rows(rig, 2, victims) == ds[0] + ds[1][6:], (
            "layers 0-1 swapped, 2-3 untouched")
        assert req.last_node is rig.cache.root_node and req.lock.node is rig.cache.root_node
        assert req.kv.cache_protected_len == 0
        assert tree.match(A).prefix_len == 0 and tree.match(ds[0]).prefix_len == 0
        d1 = tree.match(ds[1])
        assert (d1.device_len, d1.prefix_len) == (6, 6), "D1's swapped tail stayed"
        assert all(tree.match(p).tokens_from(DONOR) == 8 for p in (B, C))
        assert all(where(rig, d) == (8, 0) for d in ds[2:])
        revoked = fault == "fenced and revoked"
        assert tree.donor.available_tokens() == (0 if revoked else 8)
        assert tree.in_flight() == tree.exchanges_in_flight() == 0
        rig.cache.check_integrity()
        assert rig.alloc.available_size() == FREE, "the hit's slots are the request's until it ends"
        release(rig, req)
        assert set(victims.tolist()) <= set(rig.alloc.free_slots)
        assert rig.alloc.available_size() == FREE + 8 and accounted(rig)
        rig.cache.check_integrity()
    finally:
        rig.close()


def test_the_cache_owned_answer_does_not_leak_into_the_next_load_back():
    """Invariant: load_back_is_cache_owned() is True only right after the init_load_back that
    exchanged: a following call with no donor hit, and a following streamed load, answer
    False."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams

    rig, _, _ = scene()
    try:
        _, _, out, owned = admit_a(rig)
        assert owned and out[0] == 8
        plain = SimpleNamespace(rid="plain", last_node=rig.cache.root_node, prefix_len=0,
                                full_untruncated_fill_ids=[1, 0])
        rig.cache.init_load_back(InitLoadBackParams(rig.cache.root_node, 0, req=plain))
        assert not rig.cache.load_back_is_cache_owned()
    finally:
        rig.close()
    rig, _, _ = scene()
    try:
        _, _, out, owned = admit_a(rig)
        assert owned and out[0] == 8
        with admission.holding(rig.cache.tree.match(B)):
            rig.cache.evict(EvictParams(num_tokens=NEED))
        assert rig.alloc.available_size() >= NEED and where(rig, B) == (0, 8)
        req, _, out, owned = load_back(rig, B, "rb")
        assert out == (8, rig.cache.root_node) and not owned
        assert rig.cache.tree.exchanges_in_flight() == 1
        assert all(run_batch(rig, req)) and rig.kv_of(req, B)  # the exchange's batch too
        assert rig.runtime.stats["loads_started"] == rig.runtime.stats["exchanges"] == 1
    finally:
        rig.close()


def test_room_made_by_demoting_a_leaf_larger_than_the_room_does_not_push_donor_prefixes_out():
    """Invariant (the exchange rule counts whole leaves): the room needed is 2 tokens, the
    donor tier has 4 free, but the eviction would demote the LRU leaf D0 whole (6 tokens) and
    push a donor prefix out; so the hit is exchanged, and nothing leaves the donor tier. (The
    first rule compared the room itself with the free room and streamed here, losing B or C.)"""
    rig, ds, _ = scene(16, (A, B, C[:4]), SIZES[:-1] + (2,))
    try:
        room = NEED - rig.alloc.available_size()
        assert (room, rig.cache.tree.donor.available_tokens(), len(ds[0])) == (2, 4, 6)
        req, _, out, owned = admit_a(rig)
        assert out[0] == 8 and owned and rig.cache.tree.exchanges_in_flight() == 1
        assert where(rig, B) == (0, 8) and where(rig, C[:4]) == (0, 4), (
            "making the hit's room pushed a donor prefix out")
        assert all(run_batch(rig, req)) and rig.kv_of(req, A)
        assert rig.runtime.stats["exchanges"] == 1
        assert where(rig, B) == (0, 8) and where(rig, C[:4]) == (0, 4)
        rig.cache.check_integrity()
    finally:
        rig.close()


def test_a_borrower_whose_donor_hits_are_exchanged_never_waits_for_the_gpu(monkeypatch):
    """Invariant: with a donor tier too small to take the room's demotions, a borrower's donor
    hits are exchanged (the tree's begin at admission, the swap started at batch start, judged and
    settled after the forward) and still no step makes the host wait for a GPU (test_sync_free's
    probe over SGLang's allocator and device-marked KV buffers and donor pages)."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    from benchmarks.instruments.sync_probe import SyncProbe
    from tests.unit import test_sync_free as sf

    probe = SyncProbe()
    kernel = sf.swift_kernels.copy_rows

    def on_device(*args, **kwargs):
        with probe.device_side():
            return kernel(*args, **kwargs)

    monkeypatch.setattr(sf.pool_transfer.sk, "copy_rows", on_device)
    with probe:
        rig = sf.Borrower(pages=24)  # 36 donor tokens: under two conversations' worth
        try:
            cache, stats = rig.cache, rig.runtime.stats
            convs = sf._conversations(4, 20)  # 80 device rows hold about three
            swapped = []

            def admit(req, m):
                cache.swift_step()
                if m.host_hit_length <= 0:
                    return None
                cache.dec_lock_ref(req.last_node)  # SGLang locks after the load-back
                out = cache.init_load_back(InitLoadBackParams(m.best_match_node,
                                                              m.host_hit_length, req=req))
                req.prefix_len += out[0]
                req.last_node = out[1]
                cache.inc_lock_ref(req.last_node)

                def run():
                    batch = SimpleNamespace(hicache_consumer_index=-1, reqs=[req])
                    cache.swift_batch_built(batch)
                    with probe.device_side():  # the forward: the model's, on the GPU
                        cache.donor_hits.counter.set_consumer(batch.hicache_consumer_index)
                        for layer in range(G.num_layers):
                            cache.donor_hits.counter.wait_until(layer)
                        cache.donor_hits.counter.set_consumer(-1)
                    cache.swift_batch_ran(SimpleNamespace(chunked_req=None), batch)
                return run

            def step(i):
                c = convs[i % len(convs)]
                c.extend(c[-1] + 1 + t for t in range(2))
                before = stats["exchanges"]
                sf._request_turn(cache, rig.alloc, c, f"r{i}", admit=admit)
                swapped.append(stats["exchanges"] - before)

            per_step = sf._counted_steps(probe, step)
            sf._assert_sync_free(per_step)
            assert all(swapped[sf.WARMUP:]), f"every counted step exchanges: {swapped}"
            assert stats["exchanges_failed"] == 0 and stats["loads_failed"] == 0
            rig.lane.submit(lambda: None).result()
            cache.swift_step()
            cache.check_integrity()
        finally:
            rig.close()
