"""Per-layer completion: SGLang's LayerDoneCounter contract, overlap of layer l's attention with
layer l+1's copy, and the abort / timeout paths (waits end and name the failed layers)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sglang_swift.dataplane import (
    BLOCK_ALIGN_BYTES,
    CpuLayerCounter,
    KVGeometry,
    LeasePacking,
    PoolLayout,
    PoolTransferEngine,
    SharedArena,
    make_layer_counter,
    map_pool,
)

G = KVGeometry(4, 2, 8, 8, torch.float16, 4)
DONOR_PAGES = 8


class FakeKVPool:
    """What SGLang 0.5.23's MHATokenToKVPool does with a registered counter."""

    def __init__(self, k, v):
        self.k_buffer, self.v_buffer, self.layer_transfer_counter = k, v, None

    def register_layer_transfer_counter(self, counter):
        self.layer_transfer_counter = counter

    def get_key_buffer(self, layer_id):
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id)
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id):
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id)
        return self.v_buffer[layer_id]


def test_duck_type_matches_sglang_layer_done_counter():
    """Invariant: the CPU counter has the LayerDoneCounter surface SGLang 0.5.23 calls, and with
    no consumer set a wait returns at once."""
    c = make_layer_counter(3)
    assert isinstance(c, CpuLayerCounter) and c.num_layers == 3 and c.consumer_index == -1
    for name in ("set_consumer", "wait_until", "update_producer", "reset"):
        assert callable(getattr(c, name))
    assert c.wait_until(2) is True  # consumer_index < 0: returns at once


def test_ring_of_slots_and_in_flight_guard():
    """Invariant: producer slots rotate through a ring of 3, and a slot still in flight is
    not reused."""
    c = CpuLayerCounter(2, num_counters=3)
    ids = [c.update_producer() for _ in range(3)]
    assert ids == [0, 1, 2]
    with pytest.raises(RuntimeError, match="still loading"):
        c.update_producer()  # slot 0 never finished
    for layer in range(2):
        c.complete(layer, producer_id=0)
    assert c.update_producer() == 0
    c.reset()
    assert c.producer_index == -1 and c.consumer_index == -1


def test_wait_blocks_until_the_layer_is_complete():
    """Invariant: wait_until(l) returns only after layer l was completed."""
    c = CpuLayerCounter(3, timeout_s=30)
    pid = c.update_producer()
    c.set_consumer(pid)
    c.complete(0)
    assert c.wait(0).ok
    got = []
    waiter = threading.Thread(target=lambda: got.append(c.wait(1)))
    waiter.start()
    assert got == []
    c.complete(1)
    waiter.join(timeout=30)
    assert got and got[0].ok


def test_fail_wakes_waiters_and_names_the_failed_layers():
    """Invariant: fail() wakes every waiter with False and names the layers that were not
    ready."""
    c = CpuLayerCounter(4, timeout_s=30)
    pid = c.update_producer()
    c.set_consumer(pid)
    c.complete(0)
    results = []
    waiter = threading.Thread(target=lambda: results.extend(c.wait(i) for i in range(4)))
    waiter.start()
    assert c.fail("donor lost") == (1, 2, 3)
    waiter.join(timeout=30)
    assert [r.ok for r in results] == [True, False, False, False]
    assert results[-1].failed_layers == (1, 2, 3) and results[-1].reason == "donor lost"
    c.complete(2)  # late news from an abandoned load changes nothing
    assert c.failed_layers() == (1, 2, 3) and c.wait_until(2) is False


def test_timeout_ends_the_wait_and_fails_the_rest():
    """Invariant: a wait past timeout_s fails the remaining layers once; later waits return
    at once."""
    c = CpuLayerCounter(3, timeout_s=0.3)
    c.set_consumer(c.update_producer())
    c.complete(0)
    t0 = time.monotonic()
    assert c.wait_until(1) is False
    assert time.monotonic() - t0 < 5
    assert c.failed_layers() == (1, 2) and c.failure_reason().startswith("timeout")
    t0 = time.monotonic()
    assert c.wait_until(2) is False and time.monotonic() - t0 < 1.0  # no second timeout


class Setup:
    """A donor pool of G's shape in a shared region, a lease of its pages in reversed order, a
    borrower pool `k` / `v` whose `slots` were stored into lease blocks `blocks`, and a
    poisoned borrower pool `k2` / `v2` to load into (`loader`)."""

    def __init__(self, n=10):
        rows = DONOR_PAGES * G.page_size
        self.layout = PoolLayout(G, rows, rows)
        size = -(-self.layout.data_bytes // BLOCK_ALIGN_BYTES) * BLOCK_ALIGN_BYTES
        self.donor = SharedArena(size)
        self.packing = LeasePacking(G, self.layout, list(range(DONOR_PAGES - 1, -1, -1)))
        self.blocks = list(range(-(-n // G.page_size)))
        self.k = [torch.randn(32, 2, 8).to(G.dtype) for _ in range(G.num_layers)]
        self.v = [torch.randn(32, 2, 8).to(G.dtype) for _ in range(G.num_layers)]
        self.slots = torch.randperm(32)[:n]
        self.engines: list[PoolTransferEngine] = []
        assert self.engine(self.k, self.v).begin_store(self.slots, self.blocks).wait(30).ok
        self.k2 = [torch.full_like(x, float("nan")) for x in self.k]
        self.v2 = [torch.full_like(x, float("nan")) for x in self.v]

    def engine(self, k, v, region=None, **kw) -> PoolTransferEngine:
        region = self.donor.memory.view(-1) if region is None else region
        eng = PoolTransferEngine(self.packing, region, k, v, **kw)
        self.engines.append(eng)
        return eng

    def loader(self, **kw) -> PoolTransferEngine:
        return self.engine(self.k2, self.v2, **kw)

    def close(self) -> None:
        for eng in self.engines:
            eng.close()
        self.donor.close()


def test_layer_l_is_readable_while_layer_l_plus_1_is_in_flight():
    """Invariant: attention on layer 0 can read its KV while the loader is held before layer 1."""
    rig = Setup()
    blocks, slots, k, v, k2, v2 = rig.blocks, rig.slots, rig.k, rig.v, rig.k2, rig.v2
    gate, at_gate = threading.Event(), threading.Event()

    def hold_before_layer_1(layer):
        if layer == 1:
            at_gate.set()
            gate.wait(30)

    try:
        counter = CpuLayerCounter(G.num_layers, timeout_s=30)
        pool = FakeKVPool(k2, v2)
        pool.register_layer_transfer_counter(counter)
        h = rig.loader().begin_load(slots, blocks, counter, before_layer=hold_before_layer_1)
        counter.set_consumer(h.producer_id)
        assert at_gate.wait(30)
        assert torch.equal(pool.get_key_buffer(0)[slots], k[0][slots])
        assert torch.equal(pool.get_value_buffer(0)[slots], v[0][slots])
        assert torch.isnan(k2[1][slots].float()).all()  # layer 1 not copied yet
        gate.set()
        for layer in range(G.num_layers):
            assert torch.equal(pool.get_key_buffer(layer)[slots], k[layer][slots])
            assert torch.equal(pool.get_value_buffer(layer)[slots], v[layer][slots])
        assert h.wait(30).ok
    finally:
        gate.set()
        rig.close()


def test_lost_donor_mid_load_fails_the_remaining_layers():
    """Invariant: the loader asks liveness before each layer; a donor lost before layer 2
    fails layers 2 and 3 and copies nothing more."""
    rig = Setup()
    alive = threading.Event()
    alive.set()

    def lose_donor_before_layer_2(layer):
        if layer == 2:
            alive.clear()

    try:
        counter = CpuLayerCounter(G.num_layers, timeout_s=30)
        h = rig.loader(liveness=alive.is_set).begin_load(
            rig.slots, rig.blocks, counter, before_layer=lose_donor_before_layer_2)
        counter.set_consumer(h.producer_id)
        oks = [counter.wait(layer).ok for layer in range(G.num_layers)]
        assert oks == [True, True, False, False]
        res = h.wait(30)
        assert not res.ok and res.failed_layers == (2, 3) and res.reason == "donor lost"
        assert torch.isnan(rig.k2[2][rig.slots].float()).all()
    finally:
        rig.close()


def test_stuck_load_times_out_and_reports_layers():
    """Invariant: a consumer's wait past the counter's timeout fails the remaining layers; the
    loader, released later, sees the abandoned slot and copies nothing more."""
    rig = Setup()
    slots, k2 = rig.slots, rig.k2
    gate = threading.Event()
    try:
        counter = CpuLayerCounter(G.num_layers, timeout_s=0.5)
        h = rig.loader().begin_load(
            slots, rig.blocks, counter, before_layer=lambda layer: layer == 1 and gate.wait(60)
        )
        counter.set_consumer(h.producer_id)
        assert counter.wait_until(0) is True
        t0 = time.monotonic()
        res = counter.wait(1)
        assert not res.ok and res.failed_layers == (1, 2, 3) and res.reason.startswith("timeout")
        assert time.monotonic() - t0 < 10
        gate.set()
        late = h.wait(30)  # the loader resumes, sees the abandoned slot and copies nothing more
        assert not late.ok and late.failed_layers == (1, 2, 3)
        assert torch.isnan(k2[1][slots].float()).all()
    finally:
        gate.set()  # let the loader thread finish; it sees the abandoned slot and stops
        rig.close()


def test_cuda_counter_records_on_the_copy_stream_and_waits_on_the_device(monkeypatch):
    """Invariant (GPU variant, with the stream module faked): complete() records one event per
    layer on the given stream; wait_until() hands that event to the current stream instead of
    blocking the host; a failed layer is never waited on."""
    from sglang_swift.dataplane import CudaLayerCounter, streams

    recorded, waited = [], []
    monkeypatch.setattr(
        streams, "record_event", lambda s: recorded.append(s) or f"ev{len(recorded)}"
    )
    monkeypatch.setattr(streams, "wait_event_on_current_stream", waited.append)
    c = CudaLayerCounter(3, timeout_s=5)
    c.set_consumer(c.update_producer())
    c.complete(0, stream="copy-stream")
    c.complete(1, stream="copy-stream")
    assert recorded == ["copy-stream", "copy-stream"]
    assert c.wait_until(0) and c.wait_until(1) and waited == ["ev1", "ev2"]
    assert c.fail("donor lost") == (2,)
    assert c.wait_until(2) is False and waited == ["ev1", "ev2"]


def test_revoked_region_mid_load_fails_the_remaining_layers():
    """Invariant: a donor revoking its region during a load is seen by the loader's liveness
    check (the mapping's header) before the next layer; nothing after it is copied."""
    rig = Setup()
    slots, k, k2 = rig.slots, rig.k, rig.k2
    mapped = map_pool({**rig.donor.export(), "layout": rig.layout.to_dict()})
    borrower = rig.loader(region=mapped.region, liveness=mapped.alive)
    try:
        counter = CpuLayerCounter(G.num_layers, timeout_s=30)
        h = borrower.begin_load(
            slots, rig.blocks, counter,
            before_layer=lambda i: i == 2 and rig.donor.revoke_export()
        )
        counter.set_consumer(h.producer_id)
        res = h.wait(30)
        assert not res.ok and res.failed_layers == (2, 3) and res.reason == "donor lost"
        assert [counter.wait_until(i) for i in range(G.num_layers)] == [True, True, False, False]
        assert torch.equal(k2[1][slots], k[1][slots]) and torch.isnan(k2[2][slots].float()).all()
    finally:
        borrower.close()
        mapped.close()
        rig.close()


@pytest.mark.parametrize(
    "problem, message",
    [("layers", "geometry has 4 layers"), ("heads", "does not match"), ("dtype", "layer 3: ")],
)
def test_engine_rejects_mismatched_buffers_before_copying(problem, message):
    """Invariant: buffers that do not match the borrower's geometry are refused, naming the
    problem, before anything is written to donor memory."""
    rig = Setup()
    k2, v2 = rig.k2, rig.v2
    try:
        if problem == "layers":
            k2, v2 = k2[:3], v2[:3]
        elif problem == "heads":
            k2 = [torch.zeros(32, 1, 8, dtype=G.dtype) for _ in k2]
        else:
            k2, v2 = k2[:3] + [k2[3].float()], v2[:3] + [v2[3].float()]
        before = rig.donor.memory.clone()
        with pytest.raises(ValueError, match=message):
            rig.engine(k2, v2)
        assert torch.equal(rig.donor.memory, before)
    finally:
        rig.close()
