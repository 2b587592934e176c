"""`RadixTree.exchange`: a donor hit swapped with device victims in place, one contract each.

Every test builds its tree from plain inserts, evictions and matches, and checks
`check_integrity()` after each operation that changes the tree.
"""

from __future__ import annotations

import pytest

from radix_ext import DEVICE, DONOR, HOST, RadixTree, TreeConfig, settle
from radix_ext.admission import holding, should_exchange

PAGES = [1, 4]


def _tree(page: int, blocks: int = 32, host: int = 0) -> RadixTree:
    t = RadixTree(TreeConfig(page_size=page, donor=True, host_capacity=host))
    if blocks:
        t.donor.add_lease("d", 0, 1, blocks)
    return t


def _key(base: int, n: int) -> list:
    return list(range(base, base + n))


def _evict_all_stores(t: RadixTree, n: int) -> None:
    """`evict_device(n)`, every store completing at once (each copy ran)."""
    plan = t.evict_device(n)
    assert plan.num_evicted == n, plan
    settle(t, plan.stores, [True] * len(plan.stores))
    t.check_integrity()


def _insert(t: RadixTree, key: list, slots: list) -> None:
    t.insert(key, slots)
    t.check_integrity()


def _snapshot(t: RadixTree):
    """Everything an operation could change: the structure, every residency's indices, locks,
    pins, and each lease's free blocks."""

    def res(r):
        return (r.tier, list(r.indices) if r.tier != DONOR else (r.donor, r.lease, list(r.blocks)))

    def walk(x):
        return (list(x.key), sorted(res(r) for r in x.res.values()), x.lock_ref, x.pins,
                sorted((str(k), walk(c)) for k, c in x.children.items()))

    leases = {k: sorted(v.free_blocks) for k, v in t.donor.leases.items()} if t.donor else {}
    return (walk(t.root), t.evictable_size(), t.protected_size(), t.leaving_size(),
            t.tier_size(DONOR), leases, sorted(n.id for n in t._dev_leaves))


class Recorder:
    """A swap callback: records its arguments (and the pins it saw), answers `ok`."""

    def __init__(self, ok: bool = True, watch=()):
        self.ok = ok
        self.calls: list = []
        self.watch = watch
        self.pins_seen: list = []

    def __call__(self, slots, blocks) -> bool:
        self.calls.append((list(slots), list(blocks)))
        self.pins_seen = [x.pins for x in self.watch]
        return self.ok

    @property
    def slots(self) -> list:
        (call,) = self.calls
        return call[0]

    @property
    def blocks(self) -> list:
        (call,) = self.calls
        return call[1]


def _donor_hit(t: RadixTree, key: list, slots: list, split_at: int = 0) -> None:
    """Put `key` in the donor tier only (as one node, or two when `split_at`)."""
    _insert(t, key, slots)
    if split_at:
        t.match(key[:split_at])  # splits the node in two
        t.check_integrity()
    _evict_all_stores(t, len(key))
    m = t.match(key)
    assert m.device_len == 0 and m.tokens_from(DONOR) == len(key)


def _hit_blocks(m) -> list:
    return [b for seg in m.loads for b in seg.source.blocks]


# ---- the swap -----------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_a_swap_puts_the_hit_on_the_victims_slots_and_the_victims_on_the_hits_blocks(page):
    P = page
    t = _tree(page)
    A, B, C, D = _key(100, 2 * P), _key(200, P), _key(300, P), _key(400, 2 * P)
    sA, sB, sC, sD = _key(0, 2 * P), _key(1000, P), _key(2000, P), _key(3000, 2 * P)
    _donor_hit(t, A, sA, split_at=P)  # the hit: two donor nodes
    for k, s in ((B, sB), (C, sC), (D, sD)):  # LRU order on the device: B, C, D
        _insert(t, k, s)
    dev, donor_tokens = t.device_size(), t.tier_size(DONOR)
    free = sorted(t.donor.leases[("d", 0)].free_blocks)

    m = t.match(A)
    hit = [seg.node for seg in m.loads]
    assert len(hit) == 2 and m.load_len == 2 * P and m.last_device_node is t.root
    a_blocks = _hit_blocks(m)
    swap = Recorder(watch=hit)
    r = t.exchange(m, swap)
    t.check_integrity()

    assert r is not None and r.ok and r.num_tokens == 2 * P and r.last_node is m.last_node
    assert not len(r.device_indices_to_free)
    assert swap.slots == sB + sC, "the least recently used device leaves, in LRU order"
    assert swap.blocks == a_blocks, "the hit's blocks, in path order"
    assert swap.pins_seen == [1, 1], "the hit is pinned while the swap runs"
    assert [x.pins for x in hit] == [0, 0], "and unpinned after it"
    # the hit: on the device, hit token i on slot i, no donor copy left
    assert [set(x.res) for x in hit] == [{DEVICE}, {DEVICE}]
    assert list(hit[0].res[DEVICE].indices) == swap.slots[:P]
    assert list(hit[1].res[DEVICE].indices) == swap.slots[P:]
    assert list(t.device_indices(r.last_node)) == swap.slots
    mA = t.match(A)
    assert mA.device_len == 2 * P and not mA.loads and mA.last_device_node is hit[-1]
    # the victims: in the donor tier, victim token i on block i // page, no device copy left
    for k, blocks in ((B, a_blocks[:1]), (C, a_blocks[1:2])):
        mk = t.match(k)
        assert mk.device_len == 0 and [s.tier for s in mk.loads] == [DONOR]
        assert set(mk.loads[0].node.res) == {DONOR}
        assert list(mk.loads[0].source.blocks) == blocks
        src = mk.loads[0].source
        assert (src.donor, src.lease, src.epoch) == ("d", 0, 1)
    mD = t.match(D)
    assert mD.device_len == 2 * P and list(t.device_indices(mD.last_node)) == sD, "D untouched"
    # neither tier gained or lost a token, nothing else was pushed out
    assert t.device_size() == dev and t.tier_size(DONOR) == donor_tokens
    assert sorted(t.donor.leases[("d", 0)].free_blocks) == free
    t.check_integrity()


@pytest.mark.parametrize("page", PAGES)
def test_after_a_swap_the_victims_are_evictable_no_more_and_the_hit_is(page):
    """The evictable-leaf set follows the swap: the hit (now the LRU device leaf after the
    victims left) is what the next eviction takes, never a victim (no longer on the device)."""
    P = page
    t = _tree(page)
    A, B = _key(100, P), _key(200, P)
    _donor_hit(t, A, _key(0, P))
    _insert(t, B, _key(1000, P))
    r = t.exchange(t.match(A), Recorder())
    assert r.ok
    t.check_integrity()
    assert t.evictable_size() == P
    plan = t.evict_device(P)
    (ticket,) = plan.stores
    assert list(ticket.src.indices) == _key(1000, P), "the hit now holds B's old slots"
    settle(t, plan.stores, [True])
    t.check_integrity()
    assert t.match(A).tokens_from(DONOR) == P and t.match(B).tokens_from(DONOR) == P


@pytest.mark.parametrize("page", PAGES)
def test_a_longer_victim_is_split_and_only_its_tail_leaves(page):
    P = page
    t = _tree(page)
    A, B, C = _key(100, P), _key(200, 3 * P), _key(300, P)
    sB = _key(1000, 3 * P)
    _donor_hit(t, A, _key(0, P))
    _insert(t, B, sB)  # the LRU device leaf, three times the hit
    _insert(t, C, _key(2000, P))
    dev = t.device_size()
    m = t.match(A)
    a_blocks = _hit_blocks(m)
    swap = Recorder()
    r = t.exchange(m, swap)
    t.check_integrity()
    assert r.ok and swap.slots == sB[2 * P :], "exactly the hit's length, from B's tail"
    mB = t.match(B)
    assert mB.device_len == 2 * P, "B's head stays on the device"
    assert list(t.device_indices(mB.last_device_node)) == sB[: 2 * P]
    assert [(s.tier, len(s.node.key), list(s.source.blocks))
            for s in mB.loads] == [(DONOR, P, a_blocks)]
    assert t.match(C).device_len == P, "C was not needed"
    assert t.device_size() == dev
    t.check_integrity()


@pytest.mark.parametrize("page", PAGES)
def test_a_parent_whose_device_children_were_all_taken_becomes_a_victim(page):
    P = page
    t = _tree(page)
    A = _key(100, 3 * P)
    parent, child = _key(200, P), _key(200, 2 * P)
    _donor_hit(t, A, _key(0, 3 * P))
    _insert(t, parent, _key(1000, P))
    _insert(t, child, _key(1000, 2 * P))  # parent [200], child [201..]: two nodes
    _insert(t, _key(300, 4 * P), _key(2000, 4 * P))  # newer than both
    m = t.match(A)
    a_blocks = _hit_blocks(m)
    swap = Recorder()
    r = t.exchange(m, swap)
    t.check_integrity()
    assert r.ok
    # the child leaf first, then its parent (a leaf once the child is taken), then the newer
    # leaf's tail
    assert swap.slots == _key(1000 + P, P) + _key(1000, P) + _key(2000 + 3 * P, P)
    mc = t.match(child)
    assert mc.device_len == 0
    assert [list(s.source.blocks) for s in mc.loads] == [a_blocks[1:2], a_blocks[:1]]


# ---- who may be a victim -------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_a_device_node_with_a_lower_copy_is_never_a_victim(page):
    P = page
    t = _tree(page)
    A, B, C = _key(100, P), _key(200, P), _key(300, P)
    _donor_hit(t, A, _key(0, P))
    _donor_hit(t, B, _key(1000, P))
    _insert(t, B, _key(1000, P))  # adopts the slots: on the device with a donor copy
    _insert(t, C, _key(2000, P))
    nodeB = t.match(B).last_node
    assert set(nodeB.res) == {DEVICE, DONOR}
    assert nodeB.last_access < t.match(C).last_node.last_access
    swap = Recorder()
    r = t.exchange(t.match(A), swap)
    t.check_integrity()
    assert r.ok and swap.slots == _key(2000, P), "B is older but has a copy: evicting it is free"
    assert set(nodeB.res) == {DEVICE, DONOR} and list(nodeB.res[DEVICE].indices) == _key(1000, P)


@pytest.mark.parametrize("page", PAGES)
def test_a_locked_node_is_never_a_victim(page):
    P = page
    t = _tree(page)
    A, B, C = _key(100, P), _key(200, P), _key(300, P)
    _donor_hit(t, A, _key(0, P))
    _insert(t, B, _key(1000, P))
    _insert(t, C, _key(2000, P))
    nodeB = t.match(B).last_node
    t.match(C)  # B is the LRU one again
    t.lock(nodeB)
    swap = Recorder()
    r = t.exchange(t.match(A), swap)
    t.check_integrity()
    assert r.ok and swap.slots == _key(2000, P)
    assert set(nodeB.res) == {DEVICE} and nodeB.lock_ref == 1
    t.unlock(nodeB)
    t.check_integrity()


@pytest.mark.parametrize("page", PAGES)
def test_the_matched_device_prefix_is_never_a_victim(page):
    """The hit hangs below a device prefix: that prefix is the only evictable device leaf (its
    only child is in the donor tier), yet taking it would leave the hit under a donor node."""
    P = page
    t = _tree(page)
    prefix, full = _key(100, 2 * P), _key(100, 3 * P)
    _insert(t, full, _key(0, 3 * P))
    t.match(prefix)  # split: prefix node, then the hit node
    _evict_all_stores(t, P)  # only the leaf (the hit) leaves
    m = t.match(full)
    assert m.device_len == 2 * P and m.load_len == P and m.last_device_node in t._dev_leaves
    before = _snapshot(t)
    swap = Recorder()
    assert t.exchange(m, swap) is None, "no victim but the prefix itself"
    assert not swap.calls and _snapshot(t) == before
    t.check_integrity()
    # with another leaf around, that one is taken and the prefix stays
    _insert(t, _key(500, P), _key(3000, P))
    m = t.match(full)
    r = t.exchange(m, swap)
    t.check_integrity()
    assert r.ok and swap.slots == _key(3000, P)
    m = t.match(full)
    assert m.device_len == 3 * P
    assert list(t.device_indices(m.last_node)) == _key(0, 2 * P) + _key(3000, P)


# ---- a failed swap ------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_a_failed_swap_drops_both_sides_and_returns_the_victims_slots(page):
    P = page
    t = _tree(page)
    A, E = _key(100, 2 * P), _key(100, 3 * P)  # E: A and one more page below it
    B, C, D = _key(200, P), _key(300, P), _key(400, P)
    _donor_hit(t, E, _key(0, 3 * P))
    for k, s in ((B, _key(1000, P)), (C, _key(2000, P)), (D, _key(3000, P))):
        _insert(t, k, s)
    lease = t.donor.leases[("d", 0)]
    free = sorted(lease.free_blocks)
    dev = t.device_size()
    m = t.match(A)  # splits E: the hit is A, E's last page hangs below it
    e_blocks = _hit_blocks(t.match(E))
    t.check_integrity()
    swap = Recorder(ok=False)
    r = t.exchange(m, swap)
    t.check_integrity()
    assert r is not None and not r.ok and r.num_tokens == 2 * P and r.last_node is t.root
    assert swap.slots == _key(1000, P) + _key(2000, P)
    assert sorted(r.device_indices_to_free) == sorted(swap.slots), "the victims' slots, no more"
    for k in (A, E, B, C):
        assert t.match(k).prefix_len == 0, f"{k[0]}: half exchanged, yet still cached"
    assert t.match(D).device_len == P, "D was no victim"
    assert sorted(lease.free_blocks) == sorted(free + e_blocks), "the hit's subtree blocks are free"
    assert t.device_size() == dev - 2 * P and t.tier_size(DONOR) == 0
    t.check_integrity()


@pytest.mark.parametrize("page", PAGES)
def test_a_failed_swap_with_a_split_victim_keeps_its_head(page):
    P = page
    t = _tree(page)
    A, B = _key(100, P), _key(200, 2 * P)
    _donor_hit(t, A, _key(0, P))
    _insert(t, B, _key(1000, 2 * P))
    r = t.exchange(t.match(A), Recorder(ok=False))
    t.check_integrity()
    assert not r.ok and sorted(r.device_indices_to_free) == _key(1000 + P, P)
    mB = t.match(B)
    assert mB.prefix_len == P and mB.device_len == P
    assert t.evictable_size() == P and t.match(B).last_device_node in t._dev_leaves


# ---- two phases: an exchange in flight ----------------------------------------------------------


def _in_flight(page: int):
    """A (two donor nodes) begun as an exchange with device victims B, C (D is newer and stays);
    returns (tree, ticket, keys, A's blocks)."""
    P = page
    t = _tree(page)
    A, B, C, D = _key(100, 2 * P), _key(200, P), _key(300, P), _key(400, P)
    _donor_hit(t, A, _key(0, 2 * P), split_at=P)
    for k, s in ((B, _key(1000, P)), (C, _key(2000, P)), (D, _key(3000, P))):
        _insert(t, k, s)
    m = t.match(A)
    a_blocks = _hit_blocks(m)
    x = t.begin_exchange(m)
    t.check_integrity()
    assert x is not None and x.num_tokens == 2 * P and x.anchor is t.root
    assert list(x.slots) == _key(1000, P) + _key(2000, P) and list(x.blocks) == a_blocks
    return t, x, (A, B, C, D), a_blocks


@pytest.mark.parametrize("page", PAGES)
def test_an_exchange_in_flight_is_reached_by_no_match_until_it_completes(page):
    """Invariant (the two-phase contract): between begin_exchange and its settling, the swap is
    recorded (the hit on the victims' slots, which its caller may lock and read; the victims on
    the hit's blocks), both sides are pinned, no match reaches either side (so no other request
    reads the hit's slots or loads the victims' blocks before the copy is judged) and no
    eviction takes them; complete_exchange makes both ordinary nodes."""
    P = page
    t, x, (A, B, C, D), a_blocks = _in_flight(page)
    assert [set(n.res) for n in x.hit] == [{DEVICE}, {DEVICE}]
    assert list(t.device_indices(x.last_node)) == list(x.slots)
    assert [set(v.res) for v in x.victims] == [{DONOR}, {DONOR}]
    assert all(n.pins == 1 for n in (*x.hit, *x.victims)) and t.exchanges_in_flight() == 1
    for k in (A, B, C):
        assert t.match(k).prefix_len == 0, f"{k[0]}: a side of the exchange was matched"
    assert t.match(D).device_len == P
    assert should_exchange(t, t.match(A), P) is False
    t.lock(x.last_node)  # the request that exchanged holds the hit like any device prefix
    t.check_integrity()
    assert t.evictable_size() == P and t.evict_device(2 * P).num_evicted == P, "only D"
    t.check_integrity()
    assert t.complete_exchange(x) is x.last_node
    t.check_integrity()
    m = t.match(A)
    assert m.device_len == 2 * P and m.last_device_node is x.last_node
    assert [list(s.source.blocks) for s in t.match(C).loads] == [a_blocks[1:]]
    t.unlock(x.last_node)
    t.check_integrity()
    with pytest.raises(ValueError, match="not in flight"):
        t.complete_exchange(x)


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("free_hit_slots", [True, False])
def test_an_aborted_exchange_drops_both_sides_once_its_hit_is_unlocked(page, free_hit_slots):
    """Invariant: an exchange that failed under the forward is dropped on both sides (either may
    be half swapped), the hit's blocks go back to the donor tier, and the hit's slots are
    returned only when the caller does not hold them in a request's row; dropping a hit some
    request still locks is refused (the caller moves that lock to the anchor first) and changes
    nothing."""
    P = page
    t, x, (A, B, C, D), a_blocks = _in_flight(page)
    lease = t.donor.leases[("d", 0)]
    free = sorted(lease.free_blocks)
    t.lock(x.last_node)
    before = _snapshot(t)
    with pytest.raises(ValueError, match="still locked"):
        t.abort_exchange(x)
    assert _snapshot(t) == before and t.exchanges_in_flight() == 1
    t.unlock(x.last_node)
    out = t.abort_exchange(x, free_hit_slots=free_hit_slots)
    t.check_integrity()
    assert sorted(out) == (sorted(x.slots) if free_hit_slots else [])
    for k in (A, B, C):
        assert t.match(k).prefix_len == 0
    assert t.match(D).device_len == P and t.exchanges_in_flight() == 0
    assert sorted(lease.free_blocks) == sorted(free + a_blocks)
    assert t.device_size() == P and t.tier_size(DONOR) == 0


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("swapped", [True, False])
def test_a_revoke_during_an_exchange_takes_the_victims_and_the_exchange_settles(page, swapped):
    """Invariant: a donor reclaiming the hit's blocks while the exchange runs drops the victims
    (their new and only copy), pinned or not; the exchange then settles either way (completed:
    the hit stays on the device; aborted: it is dropped too) and the tree stays consistent."""
    P = page
    t, x, (A, B, C, D), a_blocks = _in_flight(page)
    r = t.revoke("d", 0, a_blocks)
    t.check_integrity()
    assert r.num_tokens_lost == 2 * P and t.match(B).prefix_len == t.match(C).prefix_len == 0
    if swapped:
        t.complete_exchange(x)
        assert t.match(A).device_len == 2 * P
    else:
        t.abort_exchange(x)
        assert t.match(A).prefix_len == 0
    t.check_integrity()
    assert t.exchanges_in_flight() == 0 and t.match(D).device_len == P


# ---- no exchange --------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_a_match_without_loads_is_not_exchanged(page):
    P = page
    t = _tree(page)
    _insert(t, _key(200, P), _key(1000, P))
    _insert(t, _key(300, P), _key(2000, P))
    m = t.match(_key(300, P))
    before = _snapshot(t)
    swap = Recorder()
    assert t.exchangeable(m) is None and t.exchange(m, swap) is None
    assert t.exchange(t.match(_key(900, P)), swap) is None, "a miss"
    assert not swap.calls and _snapshot(t) == before
    t.check_integrity()


def _hit_and_victims(page: int, victims: int = 2) -> tuple:
    P = page
    t = _tree(page)
    _donor_hit(t, _key(100, P), _key(0, P))
    for i in range(victims):
        _insert(t, _key(200 + 100 * i, P), _key(1000 + 1000 * i, P))
    return t, _key(100, P)


@pytest.mark.parametrize("page", PAGES)
def test_a_pinned_hit_is_not_exchanged(page):
    t, A = _hit_and_victims(page)
    m = t.match(A)
    assert t.exchangeable(m) is not None
    swap = Recorder()
    with holding(m):
        before = _snapshot(t)
        assert t.exchangeable(m) is None and t.exchange(m, swap) is None
        assert _snapshot(t) == before
    assert not swap.calls
    t.check_integrity()
    ticket = t.begin_load_back(m.last_node, _key(5000, page))  # a load in flight pins it too
    assert ticket is not None
    before = _snapshot(t)
    assert t.exchange(m, swap) is None and not swap.calls and _snapshot(t) == before
    t.abort_load_back(ticket)
    t.check_integrity()


@pytest.mark.parametrize("page", PAGES)
def test_too_few_victims_change_nothing(page):
    P = page
    t = _tree(page)
    _donor_hit(t, _key(100, 3 * P), _key(0, 3 * P))
    _insert(t, _key(200, P), _key(1000, P))
    _insert(t, _key(300, P), _key(2000, P))
    m = t.match(_key(100, 3 * P))
    before = _snapshot(t)
    swap = Recorder()
    assert t.exchange(m, swap) is None, "2 pages evictable, the hit is 3"
    assert not swap.calls and _snapshot(t) == before
    t.check_integrity()
    # a locked leaf does not count either
    _insert(t, _key(500, P), _key(3000, P))
    node = t.match(_key(500, P)).last_node
    t.lock(node)
    m = t.match(_key(100, 3 * P))
    before = _snapshot(t)
    assert t.exchange(m, swap) is None and not swap.calls and _snapshot(t) == before
    t.unlock(node)
    t.check_integrity()
    assert t.exchange(t.match(_key(100, 3 * P)), swap).ok, "enough once it is unlocked"
    t.check_integrity()


@pytest.mark.parametrize("page", PAGES)
def test_a_hit_from_the_host_tier_is_not_exchanged(page):
    P = page
    t = _tree(page, blocks=0, host=8 * P)
    _insert(t, _key(100, P), _key(0, P))
    _evict_all_stores(t, P)
    t.donor.add_lease("d", 0, 1, 8)
    _insert(t, _key(200, P), _key(1000, P))
    m = t.match(_key(100, P))
    assert [s.tier for s in m.loads] == [HOST]
    before = _snapshot(t)
    swap = Recorder()
    assert t.exchangeable(m) is None and t.exchange(m, swap) is None
    assert not swap.calls and _snapshot(t) == before
    t.check_integrity()


@pytest.mark.parametrize("page", PAGES)
def test_a_hit_spread_over_two_leases_is_not_exchanged(page):
    """The swap exchanges with blocks of one lease; a hit spread over two cannot be described."""
    P = page
    t = _tree(page, blocks=1)
    A = _key(100, 2 * P)
    _insert(t, A, _key(0, 2 * P))
    t.match(A[:P])  # two nodes
    _evict_all_stores(t, P)  # the tail, into lease d/0 (now full)
    t.donor.add_lease("e", 0, 1, 4)
    _evict_all_stores(t, P)  # the head, into lease e/0
    _insert(t, _key(200, 2 * P), _key(1000, 2 * P))
    m = t.match(A)
    assert [(s.source.donor, s.tier) for s in m.loads] == [("e", DONOR), ("d", DONOR)]
    before = _snapshot(t)
    swap = Recorder()
    assert t.exchangeable(m) is None and t.exchange(m, swap) is None
    assert not swap.calls and _snapshot(t) == before
    t.check_integrity()


def test_a_stale_match_is_not_exchanged():
    """A match whose donor copy is gone since (here: revoked after the hit was also inserted on
    the device) describes blocks the tree no longer holds for it."""
    t, A = _hit_and_victims(1)
    m = t.match(A)
    t.insert(A, [7])  # a device copy besides the donor one
    t.check_integrity()
    n = m.loads[0].node
    t.revoke("d", 0, list(n.res[DONOR].blocks))  # the donor copy is gone, the node stays
    t.check_integrity()
    swap = Recorder()
    assert t.exchangeable(m) is None and t.exchange(m, swap) is None and not swap.calls


# ---- should_exchange ----------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_should_exchange_only_when_the_donor_tier_cannot_take_the_room_and_the_hit_can_swap(page):
    P = page
    t = _tree(page, blocks=4)  # 4 pages of donor room
    _donor_hit(t, _key(100, P), _key(0, P))
    _insert(t, _key(200, 2 * P), _key(1000, 2 * P))  # the oldest device leaf, then three more
    for i, first in enumerate((300, 400, 500)):
        _insert(t, _key(first, P), _key(2000 + 1000 * i, P))
    free = t.donor.available_tokens()
    assert free == 3 * P
    m = t.match(_key(100, P))
    assert not should_exchange(t, m, 0), "no room needed"
    assert not should_exchange(t, m, free), "the donor tier takes what the room demotes"
    assert should_exchange(t, m, free + 1) and should_exchange(t, m, free + P)
    # the room is made of whole leaves: 1 token of room demotes the 2-page leaf, which fits
    assert t.demotion_volume(1) == 2 * P and not should_exchange(t, m, 1)
    assert t.demotion_volume(10 * P) == 5 * P, "no more than the device holds"
    assert not should_exchange(t, t.match(_key(200, 2 * P)), free + P), \
        "a device hit: nothing to swap"
    with holding(m):
        assert not should_exchange(t, m, free + P), "a pinned hit cannot swap"
    no_donor = RadixTree(TreeConfig(page_size=page))
    no_donor.insert(_key(100, P), _key(0, P))
    assert not should_exchange(no_donor, no_donor.match(_key(100, P)), 10 * P)
    t.check_integrity()


# ---- two bugs the first version had (both found by these tests) ----------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_a_node_with_a_leaving_device_child_is_never_a_victim(page):
    P = page
    t = _tree(page)
    _donor_hit(t, _key(100, P), _key(0, P))
    parent, child = _key(200, P), _key(200, 2 * P)
    _insert(t, parent, _key(1000, P))
    _insert(t, child, _key(1000, 2 * P))
    plan = t.evict_device(P)  # the child starts leaving; its store stays in flight
    (store,) = plan.stores
    t.check_integrity()
    swap = Recorder()
    r = t.exchange(t.match(_key(100, P)), swap)
    t.check_integrity()  # a leaving child on the device under a donor-only parent fails here
    assert r is None and not swap.calls, "the only candidate has a device child still leaving"
    settle(t, [store], [True])
    t.check_integrity()


@pytest.mark.parametrize("page", PAGES)
def test_an_exchange_leaves_a_leaving_anchor_leaving(page):
    P = page
    t = _tree(page)
    full = _key(100, 2 * P)
    _insert(t, full, _key(0, 2 * P))
    t.match(full[:P])  # the anchor, then the hit
    _evict_all_stores(t, P)  # the hit goes to the donor tier
    plan = t.evict_device(P)  # the anchor starts leaving, its store in flight
    (store,) = plan.stores
    m = t.match(full)
    assert m.device_len == P and m.load_len == P
    before = _snapshot(t)
    assert t.exchange(m, Recorder()) is None, "no victim at all"
    t.check_integrity()
    assert _snapshot(t) == before, "None: nothing changed"
    out = t.complete_store(store)
    assert sorted(out.device_indices_to_free()) == _key(0, P), "the eviction's room arrives"
