"""SwiftRuntime with SGLang's real KV pools and allocators on CPU, two models of different shapes
in one process (a donor and a borrower), real control agents over ipc, a real radix_ext tree.

Invariants: the donor lends pages of its OWN pool (they leave its allocator); a prefix the
borrower demotes is stored into those pages and loads back bit-identical; when the donor's own
traffic eats into its reserve it reclaims, the borrower drops every residency on the reclaimed
pages before acknowledging, and only then do the pages go back into the donor's allocator.
"""

from __future__ import annotations

import time
from array import array

import pytest
import torch

from radix_ext import DONOR, RadixTree, TreeConfig
from sglang_swift.dataplane import make_layer_counter
from sglang_swift.integration.runtime import SwiftRuntime
from sglang_swift.integration.swift_config import CONFIG_ENV, SwiftConfig

SLOTS = 64
DONOR_SHAPE = dict(layer_num=3, head_num=2, head_dim=8)  # 384 B of KV per token
BORROWER_SHAPE = dict(layer_num=5, head_num=1, head_dim=16)  # 640 B per token: a bigger model


@pytest.fixture(scope="module", autouse=True)
def loaded_plugins():
    from sglang.srt.plugins import load_plugins

    load_plugins()  # the hook that puts a lending server's pool in shared memory


def _pool_and_allocator(shape: dict):
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
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for rt in runtimes:
            rt.pump()
        if predicate():
            return
        time.sleep(0.01)  # the agents' I/O threads run meanwhile; this is a polling loop
    raise AssertionError("condition not reached")


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

    # An 8-token prefix (one lease holds 9 of our blocks) on the device is demoted into donor blocks (a real copy of every layer).
    tree, pool = borrower.tree, borrower.kv_pool
    slots = array("q", range(1, 9))
    expect_k = [k[1:9].clone() for k in pool.k_buffer]
    tree.insert(list(range(100, 108)), slots)
    (ticket,) = tree.evict_device(8).stores
    assert ticket.dst_tier == DONOR
    assert borrower.store([(ticket.src.indices, ticket.transfer.dst)]) == [True]
    assert list(tree.complete_store(ticket).device_indices_to_free()) == list(slots)

    # A hit loads it back into other slots, bit-identical, layer by layer.
    m = tree.match(list(range(100, 108)))
    assert m.device_len == 0 and m.load_len == 8
    new_slots = list(range(30, 38))
    ticket = tree.begin_load_back(m.last_node, new_slots)
    counter = make_layer_counter(BORROWER_SHAPE["layer_num"])
    assert borrower.load([(c.src, c.dst.indices) for c in ticket.copies], counter)
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
    assert borrower.store([(ticket.src.indices, ticket.transfer.dst)]) == [False]
    assert not tree.complete_store(ticket).ok
    assert tree.match(list(range(7))).prefix_len == 0  # nothing cached claims the lost blocks


def test_copies_are_batched_per_lease_without_reordering_a_reused_block():
    """One transfer per run of same-lease copies; a repeated block starts a new run (order kept)."""
    from radix_ext import DonorResidency
    from sglang_swift.integration.borrowing import _batches

    def res(lease, *blocks):
        return DonorResidency("d", lease, 1, array("q", blocks))

    items = [([0], res(1, 5)), ([1], res(1, 6)), ([2], res(2, 5)), ([3], res(2, 5)), ([4], res(1, 7))]
    runs = _batches(items, lambda item: item[1])
    assert runs == [(("d", 1), [0, 1]), (("d", 2), [2]), (("d", 2), [3]), (("d", 1), [4])]
