"""SwiftRuntime with SGLang's real KV pools and allocators on CPU, two models of different shapes
in one process (a donor and a borrower), real control agents over ipc, a real radix_ext tree.

Invariants: the donor lends pages of its OWN pool (they leave its allocator); a prefix the
borrower demotes is stored into those pages and loads back bit-identical, through the copies the
live server starts (`integration/copies.start_copy`); when the donor's own traffic eats into its
reserve it reclaims, the borrower's agent thread stops every copy touching the reclaimed pages
and acknowledges without waiting for the scheduler's pump, the tree forgets them at that pump,
and only after the acknowledgement do the pages go back into the donor's allocator.
"""

from __future__ import annotations

import time
from array import array

import pytest
import torch
from unit.copy_helpers import hold_in_layer

from radix_ext import DONOR, HOST, RadixTree
from sglang_swift.config import CONFIG_ENV, SwiftConfig
from sglang_swift.dataplane import make_layer_counter
from sglang_swift.integration.copies import start_copy
from sglang_swift.integration.runtime import SwiftRuntime

SLOTS = 64
DONOR_SHAPE = dict(layer_num=3, head_num=2, head_dim=8)  # 384 B of KV per token
BORROWER_SHAPE = dict(layer_num=5, head_num=1, head_dim=16)  # 640 B per token: a bigger model


_lending_hooks: list = []


def apply_lending_hooks() -> None:
    """Register and apply, in this process, what a lending server's scheduler process
    registers (among it the hook that puts its pool in shared memory); once."""
    if _lending_hooks:
        return
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_swift.integration import plugin

    load_plugins()
    lending = SwiftConfig(enabled=True, lend_fraction=0.5)
    _lending_hooks.extend(plugin.register(environ={CONFIG_ENV: lending.to_json()}) or [True])
    HookRegistry.apply_hooks()


def _pool_and_allocator(shape: dict):
    apply_lending_hooks()
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(size=SLOTS, page_size=1, dtype=torch.float32, device="cpu",
                            enable_memory_saver=False, **shape)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn_like(buf))
    return pool, TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", pool, need_sort=False)


def _runtime(tmp_path, monkeypatch, name: str, shape: dict, **cfg) -> SwiftRuntime:
    config = SwiftConfig(enabled=True, rendezvous_dir=str(tmp_path / "rv"),
                         heartbeat_interval_s=0.05, heartbeat_timeout_s=2.0, **cfg)
    monkeypatch.setenv(CONFIG_ENV, config.to_json())  # what the scheduler process sees
    pool, allocator = _pool_and_allocator(shape)
    monkeypatch.delenv(CONFIG_ENV)
    tree = RadixTree(config.tree_config(1))
    return SwiftRuntime(config, model=name, kv_pool=pool, allocator=allocator, tree=tree,
                        page_size=1, agent_id=name)


def _pump_until(runtimes, predicate, timeout_s=20.0):
    """Run the runtimes' scheduler-thread steps (pump, then lend, as `swift_step` does) until
    `predicate()` holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for rt in runtimes:
            rt.pump()
            rt.lend()
        if predicate():
            return
        time.sleep(0.01)  # the agents' I/O threads run meanwhile; this is a polling loop
    raise AssertionError("condition not reached")


def _copy(runtime, key, slots, blocks, counter=None) -> bool:
    """Store (or, with `counter`, load) through the live server's copy path; True if it ran."""
    copy = start_copy(runtime, key, list(slots), list(blocks), counter)
    if copy is None:
        return False
    try:
        return copy.handle.wait(30).ok
    finally:
        copy.release()


@pytest.fixture
def pair(tmp_path, monkeypatch):
    donor = _runtime(tmp_path, monkeypatch, "donor", DONOR_SHAPE, role="donor",
                     lend_fraction=0.5)
    borrower = _runtime(tmp_path, monkeypatch, "borrower", BORROWER_SHAPE, role="borrower",
                        max_borrow_blocks=16)
    donor.start()
    borrower.start()
    try:
        yield donor, borrower
    finally:
        borrower.stop()
        donor.stop()


def test_store_load_and_reclaim_through_live_agents(pair):
    """Lending comes out of the donor's own pool and goes back into it after the ack."""
    donor, borrower = pair
    _pump_until(pair, lambda: borrower.tree.donor.capacity_tokens() == 16)
    # 64-token pool, lend fraction 0.5: 32 pages left the donor's allocator, and SGLang's
    # accounting sees them as in use (available + lent == pool)
    assert donor.lent_tokens == 32 and donor.allocator.available_size() == 32
    assert donor.usable_tokens() == 32 and borrower.borrowed_tokens() == 16
    # what `ctl status` shows per server (pushed to the agent on each pump)
    cap = donor.agent.status().capacity
    assert (cap.kv_pool_tokens, cap.lent_tokens, cap.usable_tokens) == (SLOTS, 32, 32)
    assert borrower.agent.status().capacity.borrowed_tokens == 16

    # An 8-token prefix (one lease holds 9 of our blocks) on the device is demoted into donor
    # blocks (a real copy of every layer).
    tree, pool = borrower.tree, borrower.kv_pool
    slots = array("q", range(1, 9))
    expect_k = [k[1:9].clone() for k in pool.k_buffer]
    tree.insert(list(range(100, 108)), slots)
    (ticket,) = tree.evict_device(8).stores
    assert ticket.dst_tier == DONOR
    dst = ticket.transfer.dst
    assert _copy(borrower, (dst.donor, dst.lease), ticket.src.indices, dst.blocks)
    assert list(tree.complete_store(ticket).device_indices_to_free()) == list(slots)

    # A hit loads it back into other slots, bit-identical, layer by layer.
    m = tree.match(list(range(100, 108)))
    assert m.device_len == 0 and m.load_len == 8
    new_slots = list(range(30, 38))
    ticket = tree.begin_load_back(m.last_node, new_slots)
    counter = make_layer_counter(BORROWER_SHAPE["layer_num"])
    (c,) = ticket.copies
    assert _copy(borrower, (c.src.donor, c.src.lease), c.dst.indices, c.src.blocks, counter)
    assert tree.complete_load_back(ticket).ok
    for layer in range(BORROWER_SHAPE["layer_num"]):
        assert torch.equal(pool.k_buffer[layer][30:38], expect_k[layer])

    # The donor's own demand wins: its traffic takes all its free room, so it reclaims every
    # lent page; the borrower forgets the blocks before acknowledging, and only then do the
    # pages go back into the donor's allocator.
    own = donor.allocator.alloc(donor.allocator.available_size())
    assert own is not None
    _pump_until(pair, lambda: donor.lent_tokens == 0)
    assert borrower.stats["reclaims"] > 0
    assert donor.allocator.available_size() == 32 and donor.usable_tokens() == SLOTS  # all back
    assert tree.tier_size(DONOR) == 0
    tree.check_integrity()
    assert tree.match(list(range(100, 108))).device_len == 8  # the device copy is untouched
    donor.lender.check_integrity()


def test_a_donor_whose_own_requests_need_lent_pages_gets_them_within_its_step(pair):
    """A burst beyond the donor's free room: its `lend` step demands the pages and waits (at
    most OWN_PAGES_WAIT_S) for the borrower's agent thread to acknowledge, so the pages are back
    in its allocator before SGLang would admit the burst. With the borrower's agent stopped
    (no acknowledgement) the step still returns within the bound."""
    from types import SimpleNamespace as NS

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_swift.integration.runtime import OWN_PAGES_WAIT_S

    donor, borrower = pair
    _pump_until(pair, lambda: borrower.tree.donor.capacity_tokens() == 16)
    free = donor.allocator.available_size()
    burst = NS(waiting_queue=[Req("b", "", list(range(free + 8)),
                                  SamplingParams(max_new_tokens=4))],
               running_batch=NS(reqs=[]), new_token_ratio_tracker=NS(current=1.0))
    start = time.monotonic()
    donor.pump()
    donor.lend(burst)
    took = time.monotonic() - start
    assert donor.lent_tokens == 0 and donor.allocator.available_size() == SLOTS, took
    assert took < OWN_PAGES_WAIT_S + 0.5 and donor.stats["own_pages_wait_s"] > 0

    # lend again, then a borrower that does not acknowledge (its agent thread declines to
    # fence and its scheduler loop is not run): the wait ends at its bound
    donor.lender._quiet_until = 0.0
    # a lease the donor granted after the burst (the borrower's count alone may still be the
    # reclaimed lease's, whose revocation its next pump applies)
    _pump_until(pair, lambda: donor.lent_tokens > 0 and borrower.borrowed_tokens() > 0
                and any(ls.donor == "donor" for ls in donor.agent.status().leases))
    lent = donor.lent_tokens
    borrower.borrowing.fence = lambda ev: False
    free = donor.allocator.available_size()
    burst.waiting_queue = [Req("c", "", list(range(free + 8)), SamplingParams(max_new_tokens=4))]
    start = time.monotonic()
    donor.pump()
    donor.lend(burst)
    took = time.monotonic() - start
    # pages only offered came back at once; the leased ones stay out, demanded, unacknowledged
    assert 0 < donor.lent_tokens <= lent and donor.lender.demanded == donor.lent_tokens
    assert OWN_PAGES_WAIT_S * 0.9 <= took < OWN_PAGES_WAIT_S + 0.5


def test_a_flushed_allocator_does_not_hand_out_lent_pages(pair):
    """SGLang's /flush_cache (`Scheduler.flush_cache`, idle server) resets the tree and clears
    the allocator, lent pages included. The donor's next step, which runs before anything is
    admitted and before SGLang's idle memory check, takes the lent pages out again: none is
    handed to the donor's own requests while a borrower holds it, and SGLang's accounting
    (available + lent == pool) holds."""
    donor, borrower = pair
    _pump_until(pair, lambda: borrower.tree.donor.capacity_tokens() == 16)
    lent = set(donor.lender.lent)
    assert lent and donor.allocator.available_size() + donor.lent_tokens == SLOTS
    donor.allocator.clear()  # what Scheduler.flush_cache does after resetting the tree
    donor.lend()
    assert donor.lender.lent == lent
    assert donor.allocator.available_size() + donor.lent_tokens == SLOTS
    handed_out = set(donor.allocator.alloc(donor.allocator.available_size()).tolist())
    assert not handed_out & lent and len(handed_out) == SLOTS - len(lent)


def _pump_for(runtime, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        runtime.pump()
        runtime.lend()
        time.sleep(0.01)


def test_reclaim_is_acked_from_the_agent_thread_once_the_copy_in_flight_stopped(pair):
    """Race: a load reads the reclaimed pages while the reclaim lands. The borrower acknowledges
    without its scheduler ever pumping, but only after the layer the load was copying finished
    (no later layer starts); until its next pump the tree still lists the blocks and every copy
    touching them is refused; that pump then revokes them."""
    donor, borrower = pair
    _pump_until(pair, lambda: borrower.tree.donor.capacity_tokens() == 16)
    tree = borrower.tree
    tree.insert(list(range(100, 108)), array("q", range(1, 9)))
    (ticket,) = tree.evict_device(8).stores
    dst = ticket.transfer.dst
    key, blocks = (dst.donor, dst.lease), list(dst.blocks)
    assert _copy(borrower, key, ticket.src.indices, blocks)
    tree.complete_store(ticket)
    held = borrower.borrowing.leases[key]
    engine = held.engine
    log = []
    inside, go = hold_in_layer(engine, 1, log)  # layer 1 reads donor pages until `go`
    layers = BORROWER_SHAPE["layer_num"]
    load = start_copy(borrower, key, list(range(30, 38)), blocks, make_layer_counter(layers))
    try:
        assert load is not None and inside.wait(10)
        # the donor's own traffic takes its free room; from here on only the DONOR's loop runs
        assert donor.allocator.alloc(donor.allocator.available_size()) is not None
        _pump_until([donor], lambda: load.handle._abort.is_set())  # the borrower's agent fences
        _pump_for(donor, 1.0)
        # pages offered but never granted came back at once; the lease's pages did not
        assert donor.lent_tokens >= len(held.pages), \
            "acknowledged while a copy still read the reclaimed pages"
        log.append(("go", None))
    finally:
        go.set()
    _pump_until([donor], lambda: donor.lent_tokens == 0)  # back, with no borrower pump at all
    assert log == [("start", 0), ("end", 0), ("start", 1), ("go", None), ("end", 1)]
    result = load.handle.wait(30)
    assert not result.ok and set(range(2, layers)) <= set(result.failed_layers)
    load.release()
    assert len(donor.lender.reclaim_latencies) == 1

    # before the borrower's pump: the tree still lists the blocks, no copy may touch them
    assert tree.tier_size(DONOR) == 8 and engine.fenced(blocks)
    # (the whole lease went back, so the agent holds no read deadline for it any more either)
    assert start_copy(borrower, key, list(range(40, 48)), blocks) is None
    refused = engine.begin_load(list(range(40, 48)), blocks, make_layer_counter(layers))
    assert refused.result().reason.startswith("blocks fenced")
    assert ("start", 2) not in log
    borrower.pump()  # the scheduler's next step: the tree forgets the blocks
    assert tree.tier_size(DONOR) == 0 and borrower.stats["reclaims"] >= 1
    tree.check_integrity()


def test_copy_refused_after_the_lease_is_gone(pair):
    """A store into a lease whose donor left is refused, and the tree keeps nothing of it."""
    donor, borrower = pair
    _pump_until(pair, lambda: borrower.tree.donor.capacity_tokens() == 16)
    tree = borrower.tree
    tree.insert(list(range(7)), array("q", range(1, 8)))
    (ticket,) = tree.evict_device(7).stores
    donor.stop()  # the donor leaves: its leases end
    _pump_until([borrower], lambda: borrower.stats["lost_leases"] > 0)
    assert ticket.stale, "the lost lease must make the store in flight stale"
    dst = ticket.transfer.dst
    assert start_copy(borrower, (dst.donor, dst.lease), list(ticket.src.indices),
                      list(dst.blocks)) is None
    assert not tree.complete_store(ticket).ok
    assert tree.match(list(range(7))).prefix_len == 0  # nothing cached claims the lost blocks


def test_copies_are_batched_per_lease_without_reordering_a_reused_block():
    """One transfer per run of same-lease copies; a repeated block starts a new run (order kept)."""
    from radix_ext import DonorResidency
    from sglang_swift.integration.copies import runs_by_lease

    def res(lease, *blocks):
        return DonorResidency("d", lease, 1, array("q", blocks))

    items = [res(1, 5), res(1, 6), res(2, 5), res(2, 5), res(1, 7)]
    runs = runs_by_lease(items)
    assert runs == [(("d", 1), [0, 1]), (("d", 2), [2]), (("d", 2), [3]), (("d", 1), [4])]


def test_the_first_lease_is_sized_in_the_donors_pages(pair):
    """The donor advertises its pool's layout in its Hello, so the borrower's first request
    counts the donor pages its blocks need (another model's shape): one lease holds every block
    it wants, where a request of one page per block got a fraction of them and a second lease."""
    donor, borrower = pair
    _pump_until(pair, lambda: borrower.tree.donor.capacity_tokens() == 16)
    assert len(borrower.borrowing.leases) == 1
    (held,) = borrower.borrowing.leases.values()
    assert held.packing.num_blocks == 16
    advertised = borrower.agent.donor_layout()
    assert advertised is not None and advertised.num_layers == DONOR_SHAPE["layer_num"]


def test_the_agent_thread_ack_logs_where_the_fence_spent_its_time(pair, caplog):
    """The borrower's acknowledgement from its agent thread is logged after the ack left, with
    the fence's steps and, with the instruments' reclaim probe on the debug seam, where the
    thread's time went (CPU, runnable, blocked, collections)."""

    from benchmarks.instruments import traces
    from sglang_swift.integration import debug_seam

    traces.install(debug_seam.OBSERVERS, {traces.RECLAIM_SPLIT_ENV: "1"})
    try:
        _ack_logs_where_the_fence_spent_its_time(pair, caplog)
    finally:
        debug_seam.reset()


def _ack_logs_where_the_fence_spent_its_time(pair, caplog):
    import logging

    donor, borrower = pair
    _pump_until(pair, lambda: borrower.tree.donor.capacity_tokens() == 16)
    caplog.set_level(logging.INFO, logger="sglang_swift.integration.runtime")
    assert donor.allocator.alloc(donor.allocator.available_size()) is not None
    _pump_until([donor], lambda: donor.lent_tokens == 0)  # the borrower's scheduler never pumps

    def acked():
        return [r.getMessage() for r in caplog.records if "of fencing" in r.getMessage()]

    deadline = time.monotonic() + 5
    while not acked() and time.monotonic() < deadline:
        time.sleep(0.01)
    (line,) = acked()
    assert "from the agent thread" in line and "blocks found in" in line
    assert "on a CPU" in line and "blocked" in line and "gen0/1/2" in line
    assert borrower.borrowing.last_fence.blocks == 16


def test_the_relend_cooldown_is_the_donors_option(tmp_path, monkeypatch):
    """`--swiftcache-relend-cooldown-s`: after a reclaim, the donor lends again once that long
    has passed, not before (the default is 5 s; here 0.3 s)."""
    from types import SimpleNamespace as NS

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    cooldown = 0.3
    donor = _runtime(tmp_path, monkeypatch, "donor", DONOR_SHAPE, role="donor",
                     lend_fraction=0.5, relend_cooldown_s=cooldown)
    borrower = _runtime(tmp_path, monkeypatch, "borrower", BORROWER_SHAPE, role="borrower",
                        max_borrow_blocks=16)
    pair = (donor.start(), borrower.start())
    try:
        assert donor.lender.relend_cooldown_s == cooldown
        _pump_until(pair, lambda: borrower.borrowed_tokens() > 0)
        burst = NS(waiting_queue=[Req("b", "", list(range(donor.allocator.available_size() + 8)),
                                      SamplingParams(max_new_tokens=4))],
                   running_batch=NS(reqs=[]), new_token_ratio_tracker=NS(current=1.0))
        donor.pump()
        demanded = time.monotonic()  # the cooldown counts from the demand, inside lend()
        donor.lend(burst)
        assert donor.lent_tokens == 0
        _pump_until(pair, lambda: donor.lent_tokens > 0, timeout_s=4.0)  # the default: 5 s
        assert time.monotonic() - demanded >= cooldown
    finally:
        borrower.stop()
        donor.stop()


def test_a_reclaim_moves_the_donor_tier_into_host_memory_instead_of_dropping_it(
        tmp_path, monkeypatch):
    """With a host tier, the borrower reads the reclaimed blocks on the agent's thread before
    it acknowledges, and the tree keeps their prefixes in host slots: the same bytes."""
    from sglang_swift.dataplane.reclaim_staging import ReclaimStaging
    from sglang_swift.integration.host_tier import HostKV

    donor = _runtime(tmp_path, monkeypatch, "donor", DONOR_SHAPE, role="donor",
                     lend_fraction=0.5)
    borrower = _runtime(tmp_path, monkeypatch, "borrower", BORROWER_SHAPE, role="borrower",
                        max_borrow_blocks=16)
    host = HostKV(borrower.kv_pool, ratio=1.0, size_gb=0, layout="layer_first",
                  io_backend="kernel", page_size=1)
    borrower.tree = RadixTree(borrower.config.tree_config(1, host.capacity))
    borrower.borrowing.staging = ReclaimStaging(host.write_rows)
    donor.start()
    borrower.start()
    try:
        pair = (donor, borrower)
        _pump_until(pair, lambda: borrower.tree.donor.capacity_tokens() == 16)
        tree, pool = borrower.tree, borrower.kv_pool
        slots = array("q", range(1, 9))
        expect = [(k[1:9].clone(), v[1:9].clone()) for k, v in zip(pool.k_buffer, pool.v_buffer)]
        tree.insert(list(range(100, 108)), slots)
        (ticket,) = tree.evict_device(8).stores
        assert ticket.dst_tier == DONOR
        dst = ticket.transfer.dst
        assert _copy(borrower, (dst.donor, dst.lease), ticket.src.indices, dst.blocks)
        tree.complete_store(ticket)
        for buf in pool.k_buffer + pool.v_buffer:  # the device rows are reused meanwhile
            buf.zero_()

        own = donor.allocator.alloc(donor.allocator.available_size())
        assert own is not None
        _pump_until(pair, lambda: donor.lent_tokens == 0)
        assert tree.tier_size(DONOR) == 0 and tree.tier_size(HOST) == 8
        assert borrower.stats["revoked_tokens"] == 0 and borrower.stats["rescued_tokens"] == 8
        assert borrower.stats["reclaim_overflow_tokens"] == 0
        m = tree.match(list(range(100, 108)))
        assert m.load_len == 8 and [s.tier for s in m.loads] == [HOST]
        _assert_host_rows(host, pool, m.loads[0].source, 30, expect)
        tree.check_integrity()
    finally:
        borrower.stop()
        donor.stop()


def test_a_reclaim_counts_what_device_and_host_could_not_hold_without_the_lent_pages(
        tmp_path, monkeypatch):
    """Two 8-token prefixes in the donor tier, the device pool full but for 4 tokens of cached
    prefixes, an 8-token host tier: once the lease is gone the tiers hold 4 tokens fewer than
    the tree had, so the reclaim's overflow is 4 (what any placement must drop); the rescue
    keeps one prefix in host and drops the other (8 tokens: a prefix goes whole)."""
    from sglang_swift.dataplane.reclaim_staging import ReclaimStaging
    from sglang_swift.integration.host_tier import HostKV

    donor = _runtime(tmp_path, monkeypatch, "donor", DONOR_SHAPE, role="donor",
                     lend_fraction=0.5)
    borrower = _runtime(tmp_path, monkeypatch, "borrower", BORROWER_SHAPE, role="borrower",
                        max_borrow_blocks=16)
    host = HostKV(borrower.kv_pool, ratio=1.0, size_gb=0, layout="layer_first",
                  io_backend="kernel", page_size=1)
    borrower.tree = RadixTree(borrower.config.tree_config(1, 8))
    borrower.borrowing.staging = ReclaimStaging(host.write_rows)
    donor.start()
    borrower.start()
    try:
        pair = (donor, borrower)
        _pump_until(pair, lambda: borrower.tree.donor.capacity_tokens() == 16)
        tree = borrower.tree
        for base in (100, 200):
            tree.insert(list(range(base, base + 8)), array("q", range(1, 9)))
            (ticket,) = tree.evict_device(8).stores
            assert ticket.dst_tier == DONOR
            dst = ticket.transfer.dst
            assert _copy(borrower, (dst.donor, dst.lease), ticket.src.indices, dst.blocks)
            tree.complete_store(ticket)
        size = borrower.usable_tokens()
        tree.insert(list(range(1000, 1000 + size - 4)), array("q", range(size - 4)))
        assert tree.held_tokens() == size + 12
        assert borrower.cache_capacity_tokens() == size + 8 + 16

        own = donor.allocator.alloc(donor.allocator.available_size())
        assert own is not None
        _pump_until(pair, lambda: donor.lent_tokens == 0)
        assert borrower.stats["reclaim_overflow_tokens"] == 4
        assert borrower.stats["rescued_tokens"] == 8 and borrower.stats["revoked_tokens"] == 8
        assert tree.held_tokens() == size + 4
        tree.check_integrity()
    finally:
        borrower.stop()
        donor.stop()


def _assert_host_rows(host, pool, source, at: int, expect) -> None:
    """Host residency `source` (8 tokens) loaded into device slots `at..at+7` equals `expect`
    (per layer, K and V rows)."""
    rows = torch.as_tensor(source.indices)
    dst = torch.arange(at, at + 8)
    for layer in range(BORROWER_SHAPE["layer_num"]):
        host.load_layer(rows, dst, layer)
        assert torch.equal(pool.k_buffer[layer][at:at + 8], expect[layer][0])
        assert torch.equal(pool.v_buffer[layer][at:at + 8], expect[layer][1])


class _Slots:
    """The device slots `Demotions` frees (the allocator's own free list)."""

    def __init__(self, allocator):
        self.allocator = allocator

    def free(self, indices) -> None:
        self.allocator.free(torch.as_tensor(list(indices), dtype=torch.int64))


def _cascading_borrower(tmp_path, monkeypatch, host_tokens: int, storage=None):
    """A donor and a borrower whose tree has both lower tiers with cascade "down" (the live CPU
    server's), its host tier `host_tokens` of a real host pool, and the borrower's `Demotions`;
    with `storage` (a stand-in of the cache's L3 calls) the tree names the donor copies it
    drops, as with L3 below the host tier."""
    from collections import defaultdict
    from types import SimpleNamespace as NS

    from sglang_swift.integration.demotion import Demotions
    from sglang_swift.integration.host_tier import HostKV

    donor = _runtime(tmp_path, monkeypatch, "donor", DONOR_SHAPE, role="donor",
                     lend_fraction=0.5)
    borrower = _runtime(tmp_path, monkeypatch, "borrower", BORROWER_SHAPE, role="borrower",
                        max_borrow_blocks=16)
    host = HostKV(borrower.kv_pool, ratio=1.0, size_gb=0, layout="layer_first",
                  io_backend="kernel", page_size=1)
    borrower.tree = RadixTree(borrower.config.tree_config(1, host_tokens, donor_to_host=True,
                                                          l3_below=storage is not None))
    assert borrower.tree.config.cascade == "down"
    from sglang_swift.integration.storage_hits import NoStorageHits

    seat = NS(tree=borrower.tree, slots=_Slots(borrower.allocator))
    stats = defaultdict(int)  # the cache's counters (SwiftRadixCache adds its own to the runtime's)
    return donor, borrower, host, Demotions(
        seat, borrower, stats, host_kv=host,
        storage=storage if storage is not None else NoStorageHits())


def _fill_both_tiers(borrower, demotions, pair, reload_c: bool = True):
    """Prefixes a and b fill the 16-block lease, c the 8-token host tier and then (`reload_c`)
    comes back onto the device (its host copy kept: dropping it loses nothing), locked; d is
    inserted, to be evicted. Returns (a's KV rows as they were, the keys, c's node)."""
    tree, pool, alloc = borrower.tree, borrower.kv_pool, borrower.allocator
    _pump_until(pair, lambda: tree.donor.capacity_tokens() == 16)
    keys = {name: list(range(base, base + 8)) for name, base in
            (("a", 100), ("b", 200), ("c", 300), ("d", 400))}
    rows_a = None
    for name in "abc":
        slots = alloc.alloc(8)
        if name == "a":
            rows_a = [(k[slots].clone(), v[slots].clone())
                      for k, v in zip(pool.k_buffer, pool.v_buffer)]
        tree.insert(keys[name], array("q", slots.tolist()))
        assert demotions.make_room(8) == 8
    assert tree.tier_size(DONOR) == 16 and tree.tier_size(HOST) == 8
    for buf in pool.k_buffer + pool.v_buffer:  # the device rows are reused meanwhile
        buf.zero_()
    m = tree.match(keys["c"])
    if reload_c:
        ticket = tree.begin_load_back(m.last_node, array("q", alloc.alloc(8).tolist()))
        assert tree.complete_load_back(ticket).ok  # (its bytes do not matter here)
    tree.insert(keys["d"], array("q", alloc.alloc(8).tolist()))
    return rows_a, keys, m.last_node


def test_a_copy_pushed_out_of_a_full_lease_moves_into_host_with_its_bytes(tmp_path, monkeypatch):
    """d's demotion makes room in the lease by pushing out a, the oldest; host is full, but its
    copy of c (back on the device) loses nothing when dropped: a moves into those host slots,
    read from the donor pages before d's store rewrites them, and loads back bit for bit."""
    donor, borrower, host, demotions = _cascading_borrower(tmp_path, monkeypatch, 8)
    donor.start()
    borrower.start()
    try:
        pair = (donor, borrower)
        rows_a, keys, c_node = _fill_both_tiers(borrower, demotions, pair)
        tree, pool = borrower.tree, borrower.kv_pool
        assert demotions.make_room(8) == 8  # d leaves
        assert demotions.stats["donor_to_host_tokens"] == 8
        m = tree.match(keys["a"])
        assert m.load_len == 8 and [s.tier for s in m.loads] == [HOST]
        assert [s.tier for s in tree.match(keys["d"]).loads] == [DONOR]
        assert HOST not in c_node.res  # its duplicate host copy made the room
        _assert_host_rows(host, pool, m.loads[0].source, 50, rows_a)
        tree.check_integrity()
    finally:
        borrower.stop()
        donor.stop()


def test_a_move_whose_donor_read_fails_drops_the_prefix_instead(tmp_path, monkeypatch):
    """The lease is not readable when the eviction runs (its read deadline passed): the move is
    taken back from the tree, so a is recomputed, never loaded from host rows not written."""
    donor, borrower, host, demotions = _cascading_borrower(tmp_path, monkeypatch, 8)
    donor.start()
    borrower.start()
    try:
        pair = (donor, borrower)
        _, keys, _ = _fill_both_tiers(borrower, demotions, pair)
        monkeypatch.setattr(borrower, "lease_engine", lambda *key: None)
        demotions.make_room(8)
        assert demotions.stats["donor_to_host_tokens"] == 0
        assert demotions.stats["donor_to_host_failed_tokens"] == 8
        assert borrower.tree.match(keys["a"]).prefix_len == 0
        borrower.tree.check_integrity()
    finally:
        borrower.stop()
        donor.stop()


class _L3Calls:
    """What `Demotions` hands the cache's L3 side: the dropped copies and their rows."""

    def __init__(self):
        self.spilled = []

    def spill(self, dropped, rows, page) -> int:
        from sglang_swift.dataplane.reclaim_staging import gather_rows

        for u in dropped:
            self.spilled.append((list(u.tokens), gather_rows([(u.src, 8)], rows, page)))
        return 8 * len(dropped)

    def write(self, node) -> None:
        pass


def test_with_l3_a_copy_dropped_from_a_full_lease_goes_to_l3_with_its_bytes(tmp_path,
                                                                          monkeypatch):
    """Host holds only c, newer than a: d's demotion pushes a out of the lease and no tier below
    takes it, so the eviction names it and its rows, read from the donor pages before d's store
    rewrites them, are handed to L3 (`StorageHits.spill`)."""
    storage = _L3Calls()
    donor, borrower, host, demotions = _cascading_borrower(tmp_path, monkeypatch, 8, storage)
    donor.start()
    borrower.start()
    try:
        pair = (donor, borrower)
        rows_a, keys, _ = _fill_both_tiers(borrower, demotions, pair, reload_c=False)
        assert demotions.make_room(8) == 8
        assert borrower.tree.match(keys["a"]).prefix_len == 0  # dropped from the tree
        assert [s.tier for s in borrower.tree.match(keys["c"]).loads] == [HOST]
        ((tokens, (ks, vs)),) = storage.spilled
        assert tokens == keys["a"] and demotions.stats["donor_to_l3_tokens"] == 8
        for layer in range(BORROWER_SHAPE["layer_num"]):
            assert torch.equal(ks[layer], rows_a[layer][0])
            assert torch.equal(vs[layer], rows_a[layer][1])
    finally:
        borrower.stop()
        donor.stop()
