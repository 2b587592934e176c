"""No stale bytes: a donor that dies, a reclaim that fences the blocks, or a lease lost and
granted again under a new epoch while a copy is in flight never gives that copy's bytes to a
request (pool_transfer.py "Validity after the copy", copies.InFlightCopy.confirm,
streaming.StreamingLoads.settle).

Each test holds a copy open (CPU: inside its last layer, after the check that runs before the
layer; GPU-like: enqueued, bytes not moved yet), invalidates the lease one of three ways, poisons
the donor's pages, then lets the copy complete: the layer is not released as valid, the load is
failed, and the request is aborted (never answered, never inserted) so it is recomputed.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from unit.copy_helpers import DeferredStream, defer_copies, hold_in_layer

from sglang_swift.dataplane import CpuLayerCounter
from sglang_swift.dataplane.layer_counter import FAILED, READY
from sglang_swift.integration import copies
from tests.unit.test_pool_transfer import Lease, poisoned_like, same
from tests.unit.test_streaming import G, Rig

CAUSES = ["donor_dead", "reclaim_fence", "new_epoch"]
BAD = 0x5A  # what the donor's pages hold once it no longer backs the lease


class Lifecycle:
    """The three ways a lease stops backing a copy, applied to `engine` (an epoch box it reads)."""

    def __init__(self, engine, cause: str):
        self.engine, self.cause, self.alive, self.epoch = engine, cause, [True], [7]
        engine.liveness = lambda: self.alive[0]
        engine.lease_epoch = lambda: self.epoch[0]
        self.fencer = None

    def end(self, blocks) -> None:
        """Invalidate the lease; a fence runs on its own thread (on CPU it waits for the layer
        the copy is in, as a reclaim's acknowledgement does)."""
        if self.cause == "donor_dead":
            self.alive[0] = False
        elif self.cause == "new_epoch":
            self.epoch[0] = 8
        else:
            self.fencer = threading.Thread(target=self.engine.fence, args=(list(blocks),))
            self.fencer.start()
            while self.engine.copy_fence.generation == 0:  # the fence took effect
                threading.Event().wait(0.001)

    def join(self) -> None:
        if self.fencer is not None:
            self.fencer.join(30)
            assert not self.fencer.is_alive()


@pytest.mark.parametrize("cause", CAUSES)
def test_a_layer_whose_lease_ended_during_its_copy_is_failed_not_released(cause):
    """Invariant (engine, CPU lane): the last layer's copy is held after the check before it;
    the lease ends and the donor's pages change; when the copy completes, the check after it
    fails that layer in the counter (never READY) and the transfer reports it failed."""
    lease = Lease("layers")
    P, n = lease.g.page_size, lease.g.num_layers
    nblocks = min(lease.packing.num_blocks, 4)
    assert lease.engine().begin_store(lease.slots(nblocks * P, True, 1),
                                      torch.arange(nblocks)).wait(30).ok
    k2, v2 = poisoned_like(lease.k), poisoned_like(lease.v)
    engine = lease.engine(k2, v2)
    life = Lifecycle(engine, cause)
    inside, go = hold_in_layer(engine, n - 1, [])
    counter = CpuLayerCounter(n, timeout_s=30)
    dst = lease.slots(nblocks * P, True, 2)
    handle = engine.begin_load(dst, torch.arange(nblocks), counter)
    try:
        assert inside.wait(10)
        life.end(range(nblocks))
        lease.region.fill_(BAD)  # the donor's pages no longer hold the lease's bytes
    finally:
        go.set()
    result = handle.wait(30)
    life.join()
    assert not result.ok and n - 1 in result.failed_layers, result
    state = counter._slots[handle.producer_id].state
    assert state[n - 1] == FAILED and state[: n - 1] == [READY] * (n - 1)
    assert not counter.wait(n - 1, consumer_id=handle.producer_id).ok
    # the slots did receive the changed bytes: only the check keeps them from attention
    assert same(k2[n - 1][dst], torch.full_like(k2[n - 1][dst].view(torch.uint8), BAD))
    engine.close()


def _hit(rig: Rig, tokens):
    """A donor hit admitted and in its batch: (req, batch), the copy not begun yet."""
    rig.prefix(tokens)
    rig.demote_all()
    req, _, out = rig.admit(tokens, "r")
    assert out[0] == len(tokens)
    req.slots = rig.cache.prefix_device_indices(req)
    return req, SimpleNamespace(hicache_consumer_index=-1, reqs=[req])


def _assert_aborted(rig: Rig, req, tokens) -> None:
    """After the forward: the request is finished with an abort before its output is used
    (SGLang's failed-load path: 503, the client retries and the prefix is recomputed), its KV
    never reaches the tree, and the load's ticket closes."""
    rig.cache.swift_batch_ran(SimpleNamespace(chunked_req=None), rig._batch)
    assert req.skip_radix_cache_insert and req.discard_output_reason is not None
    assert "SwiftCache" in req.discard_output_reason.message
    stats = rig.runtime.stats
    assert (stats["loads_failed"], stats["loaded_tokens"]) == (1, 0)
    assert not rig.kv_of(req, tokens), "the test did not poison what the copy read"
    rig.lane.submit(lambda: None).result()
    rig.cache.swift_step()
    assert rig.cache.tree.in_flight() == 0
    rig.cache.check_integrity()


@pytest.mark.parametrize("cause", CAUSES)
def test_a_cpu_load_whose_lease_ends_mid_copy_aborts_its_request(cause):
    """Invariant (streaming, CPU lane): the last layer of a donor hit's load is held open; the
    lease ends and the donor's pages change; the copy completes. The layer is released to
    attention only as failed (the forward goes on), and the request is aborted after the
    forward: no request is given the changed bytes."""
    rig = Rig()
    try:
        tokens = list(range(1, 9))
        req, batch = _hit(rig, tokens)
        engine = rig.runtime.engines[("d", 0)]
        life = Lifecycle(engine, cause)
        inside, go = hold_in_layer(engine, G.num_layers - 1, [])
        rig.gates.append(go)
        rig.cache.swift_batch_built(batch)
        rig._batch = batch
        assert inside.wait(10)
        life.end(range(engine.packing.num_blocks))
        engine.region.fill_(BAD)
        go.set()
        rig.forward(batch, [tokens])  # returns: a failed layer does not hang attention
        life.join()
        _assert_aborted(rig, req, tokens)
    finally:
        rig.close()


@pytest.mark.parametrize("cause", CAUSES)
def test_a_gpu_like_load_completing_after_its_lease_ended_aborts_its_request(cause,
                                                                             monkeypatch):
    """Invariant (streaming, a lane that only enqueues, as a CUDA stream): every layer is
    enqueued and released at batch start while the lease is valid; the lease ends and the
    donor's pages change; then the copy runs. The check after the copy's marker
    (`InFlightCopy.confirm`, in settle before the output is used) fails the load and the
    request is aborted."""
    stream = DeferredStream()
    monkeypatch.setattr(copies.streams, "done_marker", lambda lane: stream.marker())
    rig = Rig()
    try:
        tokens = list(range(1, 9))
        req, batch = _hit(rig, tokens)
        engine = rig.runtime.engines[("d", 0)]
        life = Lifecycle(engine, cause)
        defer_copies(engine, stream)
        rig.cache.swift_batch_built(batch)
        rig._batch = batch
        rig.lane.submit(lambda: None).result()  # every layer enqueued
        assert stream.queued and all(rig.forward(batch, [tokens]))  # released at enqueue
        life.end(range(engine.packing.num_blocks))
        engine.region.fill_(BAD)
        stream.run()  # the copy completes, reading the changed pages
        life.join()
        _assert_aborted(rig, req, tokens)
    finally:
        rig.close()


def test_a_gpu_like_load_that_stays_valid_is_kept(monkeypatch):
    """Control: the same GPU-like load with nothing ending keeps its request, and settle's
    check waits for the copy (the marker) before it decides: the KV is complete."""
    stream = DeferredStream()
    monkeypatch.setattr(copies.streams, "done_marker", lambda lane: stream.marker())
    rig = Rig()
    try:
        tokens = list(range(1, 9))
        req, batch = _hit(rig, tokens)
        rig.poison()
        defer_copies(rig.runtime.engines[("d", 0)], stream)
        rig.cache.swift_batch_built(batch)
        rig.lane.submit(lambda: None).result()
        assert all(rig.forward(batch, [tokens]))
        rig.cache.swift_batch_ran(SimpleNamespace(chunked_req=None), batch)  # confirm runs it
        assert req.discard_output_reason is None and rig.kv_of(req, tokens)
        assert not stream.queued
    finally:
        rig.close()
