"""The host tier of a TP server: every rank its own host pool, what a rank's copy decides agreed.

The ranks are threads joined by the in-process group of test_tp_runtime (the same msgpack bytes
SGLang's TP CPU group carries), each with SGLang's real MHA pool and host pool on CPU.
Invariants (integration/host_tier.py, dataplane/reclaim_staging.py):
- a reclaim under write_back moves the donor tier into host on every rank, each rank its own
  shard of the KV heads into its own host pool, bit for bit, and the trees stay alike;
- a rank that could not read the reclaimed blocks (or could not write them into host) makes
  every rank drop those prefixes: no rank keeps rows another lacks;
- a host store or load that failed on one rank fails on every rank (`HostCopyFailed`), so each
  caller drops the same prefixes everywhere;
- `forget_rescue` takes a rescue's host copies back and drops what had no other copy;
- L3 with TP is refused by the launcher with the options named; the host tier with lending or
  borrowing and TP is not.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch
from unit.test_runtime import _copy
from unit.test_tp_runtime import (
    RANK_SHAPE,
    ThreadGroup,
    _config,
    _leased,
    _on_ranks,
    _pool,
    _pump_until,
    _runtime,
)

from radix_ext import DONOR, HOST, RadixTree
from sglang_swift.dataplane.reclaim_staging import ReclaimStaging
from sglang_swift.integration.host_tier import HostCopyFailed, HostKV

KEY = list(range(100, 108))
SLOTS = range(1, 9)


def _host(pool, tp=None) -> HostKV:
    return HostKV(pool, ratio=1.0, size_gb=0, layout="layer_first", io_backend="kernel",
                  page_size=1, tp=tp)


@pytest.fixture
def tp_hosts(tmp_path, monkeypatch):
    """A TP 1 donor and a TP 2 borrower whose ranks each have a host tier (write_back)."""
    config = _config(tmp_path, role="donor", lend_fraction=0.5)
    donor = _runtime(config, "donor", _pool(monkeypatch, config, dict(layer_num=3, head_num=2,
                                                                        head_dim=8)))
    group = ThreadGroup(2)
    bconfig = _config(tmp_path, role="borrower", max_borrow_blocks=8)
    pools = [_pool(monkeypatch, bconfig, RANK_SHAPE) for _ in range(2)]
    hosts = [_host(pools[r][0], group.rank_view(r)) for r in range(2)]

    def build(r):
        rt = _runtime(bconfig, "borrower", pools[r], group.rank_view(r))
        rt.tree = RadixTree(bconfig.tree_config(1, hosts[r].capacity))
        rt.borrowing.staging = ReclaimStaging(hosts[r].write_rows)
        return rt
    ranks = _on_ranks(build, 2)
    donor.start()
    for rt in ranks:
        rt.start()
    try:
        yield donor, ranks, hosts
    finally:
        for rt in ranks:
            rt.stop()
        donor.stop()


def _demoted_to_donor(donor, ranks) -> list:
    """Every rank caches KEY on its device, demotes it into the lease (each its own shard) and
    scribbles over the device rows; returns each rank's shard of KEY's rows, per layer."""
    _pump_until(donor, ranks, _leased(ranks))
    expect = [[(k[1:9].clone(), v[1:9].clone()) for k, v in
               zip(rt.kv_pool.k_buffer, rt.kv_pool.v_buffer)] for rt in ranks]
    tickets = []
    for rt in ranks:
        rt.tree.insert(KEY, array("q", SLOTS))
        (ticket,) = rt.tree.evict_device(8).stores
        assert ticket.dst_tier == DONOR
        tickets.append(ticket)

    def store(r):
        dst = tickets[r].transfer.dst
        return ranks[r].tp.all_ok(_copy(ranks[r], (dst.donor, dst.lease), SLOTS, dst.blocks))
    assert _on_ranks(store, 2) == [True, True]
    for rt, ticket in zip(ranks, tickets):
        rt.tree.complete_store(ticket)
        for buf in rt.kv_pool.k_buffer + rt.kv_pool.v_buffer:
            buf.zero_()
    return expect


def _reclaim_all(donor, ranks) -> None:
    assert donor.allocator.alloc(donor.allocator.available_size()) is not None
    _pump_until(donor, ranks, lambda: donor.lent_tokens == 0)


def _shape(tree) -> list:
    """What decides a tree's future: each tier's size, and where KEY's copies are."""
    m = tree.match(KEY)
    return [tree.tier_size(DONOR), tree.tier_size(HOST), m.load_len,
            [(s.tier, list(s.source.indices)) for s in m.loads]]


def test_a_reclaim_moves_each_ranks_shard_into_its_own_host_pool(tp_hosts):
    donor, ranks, hosts = tp_hosts
    expect = _demoted_to_donor(donor, ranks)
    assert not torch.equal(expect[0][0][0], expect[1][0][0])  # two different shards
    _reclaim_all(donor, ranks)
    assert _shape(ranks[0].tree) == _shape(ranks[1].tree)
    for r, (rt, host) in enumerate(zip(ranks, hosts)):
        assert rt.stats["rescued_tokens"] == 8 and rt.stats["revoked_tokens"] == 0
        m = rt.tree.match(KEY)
        assert m.load_len == 8 and [s.tier for s in m.loads] == [HOST]
        rows = torch.as_tensor(m.loads[0].source.indices)
        dst = torch.arange(30, 38)
        for layer in range(RANK_SHAPE["layer_num"]):
            host.load_layer(rows, dst, layer)
            assert torch.equal(rt.kv_pool.k_buffer[layer][30:38], expect[r][layer][0])
            assert torch.equal(rt.kv_pool.v_buffer[layer][30:38], expect[r][layer][1])
        rt.tree.check_integrity()


def test_a_rank_that_could_not_read_the_blocks_makes_every_rank_drop_them(tp_hosts):
    donor, ranks, _ = tp_hosts
    _demoted_to_donor(donor, ranks)
    ranks[1].borrowing.staging.stage = lambda *args: None  # its read failed: nothing staged
    _reclaim_all(donor, ranks)
    assert _shape(ranks[0].tree) == _shape(ranks[1].tree) == [0, 0, 0, []]
    for rt in ranks:
        assert rt.stats.get("rescued_tokens", 0) == 0 and rt.stats["revoked_tokens"] == 8
        rt.tree.check_integrity()


def test_a_rank_whose_host_write_failed_makes_every_rank_take_the_rescue_back(tp_hosts):
    donor, ranks, _ = tp_hosts
    _demoted_to_donor(donor, ranks)

    def broken(*args):
        raise RuntimeError("host memory gone")
    ranks[1].borrowing.staging.write_host = broken
    _reclaim_all(donor, ranks)
    assert _shape(ranks[0].tree) == _shape(ranks[1].tree) == [0, 0, 0, []]
    for rt in ranks:
        assert rt.stats.get("rescued_tokens", 0) == 0
        assert rt.tree.host.available_tokens() == rt.tree.host.capacity_tokens()
        rt.tree.check_integrity()


def test_a_host_copy_that_failed_on_one_rank_fails_on_every_rank():
    from unit.test_host_tier import _device_pool

    group = ThreadGroup(2)
    hosts = [_host(_device_pool()[0], group.rank_view(r)) for r in range(2)]
    records = [SimpleNamespace(src=SimpleNamespace(indices=array("q", range(4))),
                               dst=SimpleNamespace(indices=array("q", range(10, 14))))]
    assert _on_ranks(lambda r: hosts[r].store_copies(records), 2) == [4, 4]

    def broken(*args):
        raise RuntimeError("copy engine fault")
    hosts[1].pool.backup_from_device_all_layer = broken
    hosts[1].pool.load_to_device_per_layer = broken

    def outcome(fn):
        def run(r):
            try:
                return fn(r)
            except HostCopyFailed as exc:
                return str(exc)
        return _on_ranks(run, 2)
    stored = outcome(lambda r: hosts[r].store_copies(records))
    assert "failed on another TP rank" in stored[0] and "copy engine fault" in stored[1]
    flipped = [SimpleNamespace(src=r.dst, dst=r.src) for r in records]
    loaded = outcome(lambda r: hosts[r].load_copies(flipped, lambda layer: None))
    assert "failed on another TP rank" in loaded[0] and "copy engine fault" in loaded[1]


def test_forget_rescue_takes_the_host_copies_back_and_drops_what_had_no_other():
    from unit.test_host_tier import _tree_with_donor_prefixes

    tree, a, b = _tree_with_donor_prefixes(host_capacity=64)
    in_donor = tree.tier_size(DONOR)
    rescued = tree.revoke("d", rescue=True)
    assert tree.tier_size(HOST) == in_donor > 0 and tree.tier_size(DONOR) == 0
    back = tree.forget_rescue(rescued.moved)
    assert tree.tier_size(HOST) == 0 and tree.host.available_tokens() == 64
    assert back.num_tokens_lost == in_donor
    assert sorted(list(p.tokens) for p in back.lost_paths) == sorted([list(a), list(b)])
    for key in (a, b):
        assert not tree.match(key, None).loads
    tree.check_integrity()


class _Ordered(set):
    """A tier's member set iterated in a given node order: as two processes' sets of the same
    nodes may be (a set's order follows the objects' addresses)."""

    reverse = False

    def __iter__(self):
        return iter(sorted(set.__iter__(self), reverse=self.reverse))


@pytest.mark.parametrize("room", [10, 64])
def test_a_rescue_decides_by_the_tree_alone_not_by_a_sets_order(room):
    """Invariant: two identical trees (the TP ranks') whose tier sets iterate in opposite orders
    rescue the same nodes into the same host slots and free the same blocks in the same order,
    also when host room is short (room for the shared root and one of two branches)."""
    from unit.test_host_tier import _tree_with_donor_prefixes

    outcomes = []
    for reverse in (False, True):
        tree, a, b = _tree_with_donor_prefixes(host_capacity=room)
        members = _Ordered(tree._in_tier[DONOR])
        members.reverse = reverse
        tree._in_tier[DONOR] = members
        result = tree.revoke("d", rescue=True)
        outcomes.append(([(x.id, list(x.res[HOST].indices)) for x in result.moved_nodes],
                         result.num_tokens_lost, [list(p.tokens) for p in result.lost_paths]))
        tree.check_integrity()
    assert outcomes[0] == outcomes[1]
    if room == 10:
        assert outcomes[0][1] == 6  # one branch found no room


def test_l3_with_tp_is_refused_by_name_and_a_tp_host_tier_with_donation_is_not():
    from sglang_swift.config import SwiftConfig
    from sglang_swift.integration.backend import tp_problems
    from sglang_swift.integration.host_tier import host_tier_problems

    args = SimpleNamespace(hicache_write_policy="write_back", hicache_storage_backend="file",
                           hicache_host_memory_mode="cache", hicache_mem_layout="layer_first",
                           tp_size=2)
    borrower = SwiftConfig.parse(enabled=True, role="borrower", max_borrow_blocks=8)
    (problem,) = host_tier_problems(args, borrower)
    assert "--hicache-storage-backend file with --tp 2" in problem and "--tp 1" in problem
    assert host_tier_problems(SimpleNamespace(**{**args.__dict__, "tp_size": 1}), borrower) == []
    assert host_tier_problems(SimpleNamespace(**{**args.__dict__,
                                                 "hicache_storage_backend": None}),
                              borrower) == []
    import dataclasses

    hosted = dataclasses.replace(borrower, host_tier=True)
    assert tp_problems(SimpleNamespace(tp_size=2), hosted) == []
