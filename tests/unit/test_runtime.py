"""SwiftRuntime without SGLang: two runtimes (a donor and a borrower) in one process, real
control agents over ipc, a real shared arena, a real radix_ext tree, stand-ins for SGLang's pool.

Invariants: a demoted prefix is stored into leased donor blocks and loads back bit-identical;
when the donor's own usage passes its watermark it reclaims, the borrower drops every residency
on the reclaimed blocks before acknowledging, and only then do the blocks return to the donor.
"""

from __future__ import annotations

import time
from array import array

import pytest
import torch

from radix_ext import DONOR, RadixTree, TreeConfig
from sglang_swift.integration.swift_config import SwiftConfig
from sglang_swift.dataplane import make_layer_counter
from sglang_swift.integration.runtime import SwiftRuntime

LAYERS, HEADS, DIM, SLOTS = 3, 2, 8, 64


class FakePool:
    """The attributes of SGLang's MHATokenToKVPool the runtime reads."""

    def __init__(self):
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = LAYERS, HEADS, DIM, DIM
        self.store_dtype = torch.float32
        self.k_buffer = [torch.randn(SLOTS + 1, HEADS, DIM) for _ in range(LAYERS)]
        self.v_buffer = [torch.randn(SLOTS + 1, HEADS, DIM) for _ in range(LAYERS)]


class FakeAllocator:
    def __init__(self, size: int):
        self.size = size
        self.free_slots = list(range(1, size + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def free(self, t: torch.Tensor) -> None:
        self.free_slots.extend(t.tolist())


def _runtime(tmp_path, name: str, **cfg) -> SwiftRuntime:
    config = SwiftConfig(enabled=True, rendezvous_dir=str(tmp_path / "rv"),
                         heartbeat_interval_s=0.05, heartbeat_timeout_s=2.0, **cfg)
    tree = RadixTree(TreeConfig(page_size=1, donor=True))
    return SwiftRuntime(config, model="tiny", kv_pool=FakePool(), allocator=FakeAllocator(SLOTS),
                        tree=tree, page_size=1, agent_id=name)


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
def pair(tmp_path):
    donor = _runtime(tmp_path, "donor", role="donor", lend_fraction=0.5)
    borrower = _runtime(tmp_path, "borrower", role="borrower", max_borrow_blocks=16)
    donor.start()
    borrower.start()
    try:
        yield donor, borrower
    finally:
        borrower.stop()
        donor.stop()


def test_store_load_and_reclaim_through_live_agents(pair):
    donor, borrower = pair
    _pump_until(pair, lambda: borrower.tree.donor.capacity_tokens() == 16)

    # A 10-token prefix on the device is demoted into donor blocks (a real copy of every layer).
    tree, pool = borrower.tree, borrower.kv_pool
    slots = array("q", range(1, 11))
    expect_k = [k[1:11].clone() for k in pool.k_buffer]
    tree.insert(list(range(100, 110)), slots)
    (ticket,) = tree.evict_device(10).stores
    assert ticket.dst_tier == DONOR
    assert borrower.store([(ticket.src.indices, ticket.transfer.dst)]) == [True]
    assert list(tree.complete_store(ticket).device_indices_to_free()) == list(slots)

    # A hit loads it back into other slots, bit-identical, layer by layer.
    m = tree.match(list(range(100, 110)))
    assert m.device_len == 0 and m.load_len == 10
    new_slots = list(range(30, 40))
    ticket = tree.begin_load_back(m.last_node, new_slots)
    counter = make_layer_counter(LAYERS)
    assert borrower.load([(c.src, c.dst.indices) for c in ticket.copies], counter)
    assert tree.complete_load_back(ticket).ok
    for layer in range(LAYERS):
        assert torch.equal(pool.k_buffer[layer][30:40], expect_k[layer])

    # The donor's own demand wins: past its watermark it reclaims; the borrower forgets the
    # blocks before acknowledging, and only then are they returned to the donor.
    donor.allocator.free_slots.clear()
    _pump_until(pair, lambda: donor.withheld and borrower.stats["reclaims"] > 0)
    assert tree.tier_size(DONOR) == 0
    assert tree.donor.available_tokens() == 0
    tree.check_integrity()
    assert tree.match(list(range(100, 110))).device_len == 10  # the device copy is untouched


def test_copy_refused_after_the_lease_is_gone(pair):
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
    from sglang_swift.integration.runtime import _batches

    def res(lease, *blocks):
        return DonorResidency("d", lease, 1, array("q", blocks))

    items = [([0], res(1, 5)), ([1], res(1, 6)), ([2], res(2, 5)), ([3], res(2, 5)), ([4], res(1, 7))]
    runs = _batches(items, lambda item: item[1])
    assert runs == [(("d", 1), [0, 1]), (("d", 2), [2]), (("d", 2), [3]), (("d", 1), [4])]
