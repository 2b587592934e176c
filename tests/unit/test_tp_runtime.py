"""A TP borrower's ranks with SGLang's real pools on CPU, real control agents over ipc, and the
ranks as threads joined by an in-process group standing in for SGLang's TP CPU group.

Invariants (integration/tp_sync.py): only rank 0 runs a control agent and every rank applies its
events at the same pump (the same leases, block counts and lease view on every rank); each rank
stores and loads only its own shard of the KV heads into the shared lease, bit for bit; a store
counts only when every rank stored; a reclaim is acknowledged (and the donor's pages come back)
only after every rank fenced it; ranks whose shards differ in shape are refused at start-up with
the shapes named."""

from __future__ import annotations

import threading

import pytest
import torch
from unit.test_runtime import DONOR_SHAPE, _copy, _pool_and_allocator

from radix_ext import DONOR, RadixTree
from sglang_swift.config import CONFIG_ENV, SwiftConfig
from sglang_swift.dataplane import make_layer_counter
from sglang_swift.integration.runtime import SwiftRuntime
from sglang_swift.integration.tp_sync import FollowerAgent, TpGroup

RANK_SHAPE = dict(layer_num=5, head_num=1, head_dim=16)  # one rank's shard of a 2-head model


class ThreadGroup(TpGroup):
    """`size` ranks as threads of this process: a collective is a barrier round over the same
    msgpack bytes SGLang's gloo group would carry (`TpGroup.share`/`gather` encode)."""

    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=30)
        self._slots: list = [None] * size

    def rank_view(self, rank: int) -> "ThreadGroup":
        view = object.__new__(ThreadGroup)
        view.__dict__ = self.__dict__.copy()
        view.rank = rank
        view._shared = self
        return view

    def _gather_bytes(self, data):
        assert isinstance(data, bytes)
        root = self._shared
        root._barrier.wait()
        root._slots[self.rank] = data
        root._barrier.wait()
        out = list(root._slots)
        root._barrier.wait()
        return out

    def _share_bytes(self, data):
        return self._gather_bytes(data)[0]


def _config(tmp_path, **cfg) -> SwiftConfig:
    return SwiftConfig(enabled=True, rendezvous_dir=str(tmp_path / "rv"),
                       heartbeat_interval_s=0.05, heartbeat_timeout_s=2.0, **cfg)


def _pool(monkeypatch, config, shape):
    monkeypatch.setenv(CONFIG_ENV, config.to_json())  # what the scheduler process sees
    pool, allocator = _pool_and_allocator(shape)
    monkeypatch.delenv(CONFIG_ENV)
    return pool, allocator


def _runtime(config, name, pool_and_allocator, tp=None) -> SwiftRuntime:
    pool, allocator = pool_and_allocator
    return SwiftRuntime(config, model=name, kv_pool=pool, allocator=allocator,
                        tree=RadixTree(config.tree_config(1)), page_size=1, agent_id=name,
                        tp=tp)


def _tp_borrower(tmp_path, monkeypatch, shapes) -> list[SwiftRuntime]:
    """One runtime per rank, built on one thread each (the shard check is a collective)."""
    group = ThreadGroup(len(shapes))
    config = _config(tmp_path, role="borrower", max_borrow_blocks=8)
    pools = [_pool(monkeypatch, config, shape) for shape in shapes]
    return _on_ranks(lambda r: _runtime(config, "borrower", pools[r], group.rank_view(r)),
                     len(shapes))


def _on_ranks(fn, ranks):
    """Run fn(rank) on one thread per rank (collectives need them all); their results."""
    out, errors = [None] * ranks, []

    def run(r):
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def _pump_until(donor, ranks, predicate, loops=2000):
    """Every rank pumps each loop (rank 0 says whether the loop is due); the donor steps."""
    def loop(r):
        for _ in range(loops):
            if r == 0:
                donor.pump()
                donor.lend()
            ranks[r].pump(due=True)
            done = ranks[r].tp.share(predicate() if r == 0 else None)
            if done:
                return True
            threading.Event().wait(0.005)
        raise AssertionError("condition not reached")
    _on_ranks(loop, len(ranks))


def _leased(ranks):
    """A lease held and offered to matches (in the view rank 0 shares)."""
    return lambda: (ranks[0].tree.donor.capacity_tokens() >= 8 and bool(ranks[0]._view)
                    and all(ranks[0]._view.values()))


@pytest.fixture
def tp_pair(tmp_path, monkeypatch):
    config = _config(tmp_path, role="donor", lend_fraction=0.5)
    donor = _runtime(config, "donor", _pool(monkeypatch, config, DONOR_SHAPE))
    ranks = _tp_borrower(tmp_path, monkeypatch, [RANK_SHAPE, RANK_SHAPE])
    donor.start()
    for rt in ranks:
        rt.start()
    try:
        yield donor, ranks
    finally:
        for rt in ranks:
            rt.stop()
        donor.stop()


def test_rank_0_negotiates_and_every_rank_applies_the_same_leases(tp_pair):
    donor, ranks = tp_pair
    assert isinstance(ranks[1].agent, FollowerAgent) and not isinstance(ranks[0].agent,
                                                                        FollowerAgent)
    _pump_until(donor, ranks, _leased(ranks))
    caps = [rt.tree.donor.capacity_tokens() for rt in ranks]
    assert caps[0] == caps[1] >= 8
    assert list(ranks[0].borrowing.leases) == list(ranks[1].borrowing.leases)
    assert ranks[0]._view == ranks[1]._view and all(ranks[0]._view.values())
    (key,) = ranks[0].borrowing.leases
    packs = [rt.borrowing.leases[key].packing for rt in ranks]
    assert [p.shard for p in packs] == [(0, 2), (1, 2)]
    assert packs[0].num_blocks == packs[1].num_blocks
    # the other ranks' copies stop at rank 0's read deadline (shared at the pump)
    assert ranks[1].agent.read_deadline(key[0]) == pytest.approx(
        ranks[0].agent.read_deadline(key[0]), abs=5.0)


def test_each_rank_stores_and_loads_its_own_shard_and_a_reclaim_waits_for_every_rank(tp_pair):
    donor, ranks = tp_pair
    _pump_until(donor, ranks, _leased(ranks))
    (key,) = ranks[0].borrowing.leases
    expect = [[k[1:9].clone() for k in rt.kv_pool.k_buffer] for rt in ranks]
    assert not torch.equal(expect[0][0], expect[1][0])  # two different shards
    blocks = list(range(8))

    def store(r):
        ok = _copy(ranks[r], key, range(1, 9), blocks)
        return ranks[r].tp.all_ok(ok)
    assert _on_ranks(store, 2) == [True, True]
    for rt in ranks:  # scribble over the device rows, then load the shard back elsewhere
        for k in rt.kv_pool.k_buffer:
            k[30:38] = 0

    def load(r):
        counter = make_layer_counter(RANK_SHAPE["layer_num"])
        return _copy(ranks[r], key, range(30, 38), blocks, counter)
    assert _on_ranks(load, 2) == [True, True]
    for r, rt in enumerate(ranks):
        for layer in range(RANK_SHAPE["layer_num"]):
            assert torch.equal(rt.kv_pool.k_buffer[layer][30:38], expect[r][layer]), (r, layer)

    # The donor's own traffic takes its room: it reclaims. No rank acknowledges from an agent
    # thread (the other ranks' copies are in other processes): while the ranks do not pump,
    # nothing comes back, however long the donor waits; at their next pump every rank fences
    # and revokes, and only then does rank 0 acknowledge.
    leased = len(ranks[0].borrowing.leases[key].pages)  # pages offered but not leased come
    own = donor.allocator.alloc(donor.allocator.available_size())
    assert own is not None
    for _ in range(50):
        donor.pump()  # back at once, those
        donor.lend()
        threading.Event().wait(0.01)
    assert donor.lent_tokens == leased, "leased pages came back before the ranks fenced"
    _pump_until(donor, ranks, lambda: donor.lent_tokens == 0)
    for rt in ranks:
        assert rt.stats["reclaims"] > 0 and rt.tree.tier_size(DONOR) == 0
        assert rt.tree.donor.capacity_tokens() == 0
        rt.tree.check_integrity()


def test_ranks_with_shards_of_different_shapes_are_refused_with_the_shapes(tmp_path,
                                                                          monkeypatch):
    with pytest.raises(ValueError, match="shards of different shapes.*rank 0: .*rank 1: "):
        _tp_borrower(tmp_path, monkeypatch, [RANK_SHAPE, dict(RANK_SHAPE, head_dim=8)])


def test_agreement_helpers_fail_an_item_that_failed_on_any_rank():
    """Invariant: `all_ok_each` and `union` give every rank the same answer, the AND (the union
    of failures) over the ranks; lists of different lengths (diverged trees) raise."""
    group = ThreadGroup(2)
    flags = [[True, True, False], [True, False, True]]
    out = _on_ranks(lambda r: group.rank_view(r).all_ok_each(flags[r]), 2)
    assert out == [[True, False, False]] * 2
    assert _on_ranks(lambda r: group.rank_view(r).union({r, 7}), 2) == [{0, 1, 7}] * 2
    with pytest.raises(RuntimeError, match="disagree on the number of items"):
        _on_ranks(lambda r: group.rank_view(r).all_ok_each([True] * (r + 1)), 2)
