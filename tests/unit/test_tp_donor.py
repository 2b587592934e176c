"""A TP donor's ranks (threads joined by the in-process group of test_tp_runtime) lending to a
--tp 1 borrower, with SGLang's real pools on CPU and real control agents over ipc.

Invariants (docs/integration.md "Tensor parallelism"): rank 0 plans and every donor rank takes
the same page ids out of its own pool at the same step; the grant names every rank's pool; the
borrower maps the donor ranks `donor_ranks_of` names (here both: one sub-lease per donor rank)
and its stores and loads land in each, bit for bit; a reclaim is acknowledged once the borrower
fenced every sub-lease, and then every donor rank frees the pages into its own allocator;
geometry that cannot be mapped is refused with the shapes named."""

from __future__ import annotations

import threading

import pytest
import torch
from unit.test_runtime import BORROWER_SHAPE, SLOTS, _copy
from unit.test_tp_runtime import ThreadGroup, _config, _on_ranks, _pool, _runtime

from radix_ext import DONOR
from sglang_swift.control import LeaseGranted, LeaseKey, MemoryDescriptor
from sglang_swift.dataplane import MappingError, pool_geometry
from sglang_swift.dataplane.borrowing import Borrowing
from sglang_swift.dataplane.layer_counter import CpuLayerCounter
from sglang_swift.dataplane.rank_map import donor_ranks_of, sub_lease_id

DONOR_RANK_SHAPE = dict(layer_num=3, head_num=1, head_dim=8)  # one rank's shard of 2 heads


@pytest.mark.parametrize("ranks, donor_ranks, want", [
    (1, 1, [[(0, (0, 1))]]),
    (2, 1, [[(0, (0, 2))], [(0, (1, 2))]]),
    (1, 2, [[(0, (0, 1)), (1, (0, 1))]]),
    (2, 2, [[(0, (0, 1))], [(1, (0, 1))]]),
    (4, 2, [[(0, (0, 2))], [(0, (1, 2))], [(1, (0, 2))], [(1, (1, 2))]]),
    (2, 4, [[(0, (0, 1)), (1, (0, 1))], [(2, (0, 1)), (3, (0, 1))]]),
])
def test_each_borrower_rank_maps_the_donor_ranks_of_the_rule(ranks, donor_ranks, want):
    """Invariant: every donor rank's pool is mapped by some borrower rank, and the shards of
    one donor pool are disjoint."""
    got = [donor_ranks_of(r, ranks, donor_ranks) for r in range(ranks)]
    assert got == want
    assert sorted({d for subs in got for d, _ in subs}) == list(range(donor_ranks))


def test_rank_counts_that_do_not_divide_are_refused_with_the_shapes():
    geometry = pool_geometry(_pool_only(BORROWER_SHAPE), 1)
    with pytest.raises(MappingError, match=r"geometry: a borrower of 2 TP ranks .*5 layers x 1 "
                                           r"KV heads x 16/16 dims.* a donor of 3 rank pools"):
        donor_ranks_of(0, 2, 3, geometry)


def _pool_only(shape):
    from unit.test_runtime import _pool_and_allocator

    return _pool_and_allocator(shape)[0]


class _Agent:
    """What Borrowing asks of its agent on a refused grant."""

    def __init__(self):
        self.released, self.avoided = [], []

    def release(self, key):
        self.released.append(key)

    def avoid_donor(self, donor):
        self.avoided.append(donor)

    def read_deadline(self, donor):
        return 0.0


def test_donor_rank_pools_of_different_shapes_are_refused_with_the_shapes(caplog):
    pool = _pool_only(BORROWER_SHAPE)
    agent = _Agent()
    borrowing = Borrowing(max_blocks=8, geometry=pool_geometry(pool, 1), kv_pool=pool,
                          agent=agent, stats={"leases": 0})
    layout = dict(num_layers=3, rows=65, padded_rows=65, head_num=1, head_dim=8, v_head_dim=8,
                  dtype="float32", page_size=1, data_offset=0)
    rank = dict(kind="shm", handle=b"/nope", device="cpu", total_bytes=8192, block_bytes=4096,
                num_blocks=1, owner_pid=1, owner_uuid="u", layout=layout)
    memory = MemoryDescriptor.coerce({**rank, "ranks": [rank, {**rank, "layout": {
        **layout, "head_dim": 4, "v_head_dim": 4}}]})
    key = LeaseKey("donor", 1, 7)
    borrowing.on_granted(LeaseGranted(1, key, (0, 1), memory), tree=None)
    assert agent.released == [key] and agent.avoided == ["donor"] and not borrowing.leases
    assert "rank pools differ in shape (rank 0: 3 layers x 1 KV heads x 8/8 dims" in caplog.text
    assert "rank 1: 3 layers x 1 KV heads x 4/4 dims" in caplog.text


@pytest.fixture
def tp_donor(tmp_path, monkeypatch):
    """Two donor ranks (threads) and a --tp 1 borrower."""
    group = ThreadGroup(2)
    config = _config(tmp_path, role="donor", lend_fraction=0.5)
    pools = [_pool(monkeypatch, config, DONOR_RANK_SHAPE) for _ in range(2)]
    ranks = _on_ranks(lambda r: _runtime(config, "donor", pools[r], group.rank_view(r)), 2)
    bconfig = _config(tmp_path, role="borrower", max_borrow_blocks=8)
    borrower = _runtime(bconfig, "borrower", _pool(monkeypatch, bconfig, BORROWER_SHAPE))
    _on_ranks(lambda r: ranks[r].start(), 2)
    borrower.start()
    try:
        yield ranks, borrower
    finally:
        borrower.stop()
        for rt in ranks:
            rt.stop()


def _run_until(ranks, borrower, predicate, loops=2000):
    """Every donor rank pumps and lends each loop (rank 0 says whether to stop); the borrower
    steps on rank 0's thread."""
    def loop(r):
        for _ in range(loops):
            ranks[r].pump(due=True)
            ranks[r].lend()
            if r == 0:
                borrower.pump()
                borrower.lend()
            if ranks[r].tp.share(predicate() if r == 0 else None):
                return
            threading.Event().wait(0.005)
        raise AssertionError("condition not reached")
    _on_ranks(loop, 2)


def test_a_tp_donor_lends_the_same_pages_of_every_rank_and_takes_them_back(tp_donor):
    ranks, borrower = tp_donor
    _run_until(ranks, borrower, lambda: len(borrower.borrowing.leases) == 2)
    assert ranks[0].lender.lent == ranks[1].lender.lent and ranks[0].lender.lent
    assert [rt.allocator.available_size() for rt in ranks][0] == \
        ranks[1].allocator.available_size()
    ((donor, lease_id), (_, sub)) = sorted(borrower.borrowing.leases)
    assert sub == sub_lease_id(lease_id, 1)
    held = [borrower.borrowing.leases[(donor, i)] for i in (lease_id, sub)]
    assert held[0].pages == held[1].pages
    # each sub-lease is one donor rank's pool, in the tree as a lease of its own
    assert held[0].engine is not held[1].engine
    assert borrower.tree.donor.capacity_tokens() == sum(h.packing.num_blocks for h in held)

    # a store into each sub-lease lands in that rank's pool, and loads back bit for bit
    pool = borrower.kv_pool
    expect = [k[1:5].clone() for k in pool.k_buffer]
    def donor_bytes():
        return [torch.cat([b.flatten() for b in rt.kv_pool.k_buffer + rt.kv_pool.v_buffer])
                for rt in ranks]
    for r, i in enumerate((lease_id, sub)):
        before = donor_bytes()
        assert _copy(borrower, (donor, i), range(1, 5), range(4))
        after = donor_bytes()
        assert not torch.equal(before[r], after[r]), f"donor rank {r}'s pool was not written"
        assert torch.equal(before[1 - r], after[1 - r]), "the other rank's pool was written"
    before = donor_bytes()
    for i, at in ((lease_id, 20), (sub, 30)):
        for k in pool.k_buffer:
            k[at:at + 4] = 0
        counter = CpuLayerCounter(BORROWER_SHAPE["layer_num"])
        assert _copy(borrower, (donor, i), range(at, at + 4), range(4), counter)
        for layer, k in enumerate(pool.k_buffer):
            assert torch.equal(k[at:at + 4], expect[layer]), (i, layer)
    assert all(torch.equal(a, b) for a, b in zip(before, donor_bytes()))  # loads only read

    # the donor's own traffic takes every rank's room alike: it reclaims, the borrower fences
    # and revokes both sub-leases, and every rank frees the pages into its own allocator
    for rt in ranks:
        assert rt.allocator.alloc(rt.allocator.available_size()) is not None
    _run_until(ranks, borrower, lambda: ranks[0].lent_tokens == 0)
    _run_until(ranks, borrower, lambda: True)  # the pump that shares the last return
    assert [rt.lent_tokens for rt in ranks] == [0, 0]
    assert ranks[0].allocator.available_size() == ranks[1].allocator.available_size() > 0
    assert borrower.tree.tier_size(DONOR) == 0 and borrower.stats["reclaims"] > 0
    assert borrower.tree.donor.capacity_tokens() == 0
    borrower.tree.check_integrity()
    for rt in ranks:
        rt.lender.check_integrity()
    assert SLOTS == ranks[1].allocator.size
