"""Stateful property test: random match/insert/lock/unlock/evict/store/load-back/revoke sequences
against a reference model, with every invariant checked after every step.

The reference model is a fake data plane. Each device slot, host slot and donor block holds the
"KV" of what the tree says it holds: the (namespace, token prefix) ending at that token. The test
plays the caller: it allocates device slots, writes contents, runs every copy the tree asks for,
frees what it is told to free. From those contents it knows which prefix is in which tier, so it
can check, independently of the tree's internals, that:
* a match is exactly the longest prefix whose every page is held somewhere, and its device part
  exactly the longest one held on the device (nothing invented, nothing forgotten);
* the indices a match or load-back hands out hold the right KV (copies and splits are right);
* no prefix is held twice in one tier, and no device slot is leaked or owned twice;
* locked prefixes stay on the device; pinned (in-flight) loads are not disturbed, and a load
  overtaken by a revoke or an insert fails cleanly;
* a store in flight keeps its device slots holding the right KV until it settles (they are never
  freed or reused before), its destination is read by nobody until it completes, an aborted
  store gives its blocks back to the lease (capacity unchanged), and a store overtaken by a
  revoke of its blocks is stale and fails; settling in any order frees every slot exactly once;
* revoke reports exactly the prefixes that lost their last copy;
plus `RadixTree.check_integrity()` after every step.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from radix_ext import DEVICE, DONOR, HOST, RadixTree, Released, StoreTicket, Transfer, TreeConfig

DEVICE_SLOTS = 48
NAMESPACES = (None, "lora-a")
keys = st.lists(st.integers(0, 3), min_size=1, max_size=10)


class TieredTreeMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 2]),
        host=st.sampled_from([0, 8, 24]),
        donor=st.booleans(),
        eviction=st.sampled_from(["lru", "cost_aware"]),
        demotion=st.sampled_from(["tiered", "cost_aware"]),
    )
    def setup(self, page, host, donor, eviction, demotion):
        self.page = page
        cfg = TreeConfig(page_size=page, host_capacity=host, donor=donor, eviction=eviction,
                         demotion=demotion)
        self.tree = RadixTree(cfg)
        self.free = set(range(DEVICE_SLOTS))
        self.dev = {}  # slot -> content, tree-owned
        self.host = {}  # host slot -> content
        self.blocks = {}  # (donor, lease, epoch, block) -> page content (tuple of token contents)
        self.epochs = Counter()
        self.locks = []  # nodes we locked (tree handles)
        self.tickets = []  # (ticket, {slot: content}) in flight
        self.stores = []  # store tickets in flight

    # ---- fake data plane ----------------------------------------------------------------------

    def _content(self, ns, key, i):
        return (ns, tuple(key[: i + 1]))

    def _read(self, tier, res):
        if tier == DEVICE:
            return [self.dev[i] for i in res.indices]
        if tier == HOST:
            return [self.host[i] for i in res.indices]
        out = []
        for b in res.blocks:
            out.extend(self.blocks[(res.donor, res.lease, res.epoch, b)])
        return out

    def _write(self, tier, res, contents):
        if tier == HOST:
            for i, c in zip(res.indices, contents):
                assert i not in self.host, "host slot handed out while still holding KV"
                self.host[i] = c
        elif tier == DONOR:
            p = self.page
            for j, b in enumerate(res.blocks):
                k = (res.donor, res.lease, res.epoch, b)
                assert k not in self.blocks, "donor block handed out while still holding KV"
                self.blocks[k] = tuple(contents[j * p : (j + 1) * p])
        else:
            raise AssertionError("the tree never copies into the device outside load-back")

    def _release(self, rel: Released, device_frees: list):
        res = rel.residency
        if rel.tier == DEVICE:
            device_frees.extend(res.indices)
        elif rel.tier == HOST:
            for i in res.indices:
                del self.host[i]
        else:
            for b in res.blocks:
                self.blocks.pop((res.donor, res.lease, res.epoch, b), None)

    def _run_steps(self, steps):
        device_frees = []
        for s in steps:
            if type(s) is Transfer:
                self._write(s.dst_tier, s.dst, self._read(s.src_tier, s.src))
            elif type(s) is StoreTicket:
                self.stores.append(s)  # the copy runs when the test decides to settle it
            else:
                self._release(s, device_frees)
        self._free_device(device_frees)

    def _free_device(self, slots):
        for i in slots:
            assert i not in self.free, f"device slot {i} freed twice"
            self.dev.pop(i)
            self.free.add(i)

    def _alloc(self, n):
        if len(self.free) < n:
            self._run_steps(self.tree.evict_device(n - len(self.free)).steps)
        if len(self.free) < n:
            return None
        return [self.free.pop() for _ in range(n)]

    # ---- the model's view ---------------------------------------------------------------------

    def _held(self):
        # A page is named by the prefix that ends it; tokens inside a page repeat across pages.
        end = lambda c: len(c[1]) % self.page == 0  # noqa: E731
        dev = Counter(c for c in self.dev.values() if end(c))
        host = Counter(c for c in self.host.values() if end(c))
        donor = Counter(c for page in self.blocks.values() for c in page if end(c))
        for tier, cnt in ((DEVICE, dev), (HOST, host), (DONOR, donor)):
            dup = [c for c, k in cnt.items() if k > 1]
            assert not dup, f"a prefix is held twice in {tier}: {dup[:1]}"
        return dev, host, donor

    def _expected(self, ns, key):
        dev, host, donor = self._held()
        n = len(key) - len(key) % self.page
        any_len = dev_len = 0
        on_dev = True
        for end in range(self.page, n + 1, self.page):
            c = self._content(ns, key, end - 1)
            if c not in dev and c not in host and c not in donor:
                break
            on_dev = on_dev and c in dev
            any_len = end
            if on_dev:
                dev_len = end
        return any_len, dev_len

    def _check_match(self, ns, key, m):
        want_any, want_dev = self._expected(ns, key)
        assert (m.prefix_len, m.device_len) == (want_any, want_dev), (
            f"match {(m.prefix_len, m.device_len)} but the data plane holds {(want_any, want_dev)}")
        got = [self.dev[i] for i in self.tree.device_indices(m.last_device_node)]
        assert got == [self._content(ns, key, i) for i in range(m.device_len)], "wrong device KV"
        pos = m.device_len
        for seg in m.loads:
            n = len(seg.node.key)
            want = [self._content(ns, key, i) for i in range(pos, pos + n)]
            assert self._read(seg.tier, seg.source) == want, "load source holds wrong KV"
            pos += n
        assert pos == m.prefix_len

    # ---- rules --------------------------------------------------------------------------------

    @rule(ns=st.sampled_from(NAMESPACES), key=keys)
    def match(self, ns, key):
        self._check_match(ns, key, self.tree.match(key, ns))

    @rule(ns=st.sampled_from(NAMESPACES), key=keys)
    def insert(self, ns, key):
        slots = self._alloc(len(key))
        if slots is None:
            return
        for i, s in enumerate(slots):
            self.dev[s] = self._content(ns, key, i)
        r = self.tree.insert(key, slots, ns)
        n = len(key) - len(key) % self.page
        # Duplicates and the unaligned tail stay ours: free them.
        self._free_device(slots[: r.duplicate_len] + slots[n:])
        self._check_match(ns, key, self.tree.match(key, ns))

    @rule(ns=st.sampled_from(NAMESPACES), key=keys)
    def lock(self, ns, key):
        m = self.tree.match(key, ns)
        if m.device_len == 0:
            return
        self.tree.lock(m.last_device_node)
        self.locks.append((m.last_device_node, ns, key[: m.device_len]))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.tree.unlock(node)

    @rule(n=st.integers(1, 24))
    def evict(self, n):
        before = self.tree.evictable_size()
        plan = self.tree.evict_device(n)
        assert plan.num_evicted >= min(n, before) or plan.num_evicted == before
        assert plan.num_evicted == plan.demoted + plan.dropped
        self._run_steps(plan.steps)

    @precondition(lambda self: self.stores)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def finish_store(self, i, ok):
        t = self.stores.pop(i % len(self.stores))
        assert not (set(t.src.indices) & self.free), "a store's device slots were freed early"
        was_stale = t.stale
        capacity = self.tree.tiers[t.dst_tier].capacity_tokens()
        if ok and not was_stale:
            # the copy reads the pinned device slots now: they must still hold the victim's KV
            self._write(t.dst_tier, t.dst, self._read(DEVICE, t.src))
            out = self.tree.complete_store(t)
        else:
            out = self.tree.complete_store(t) if ok else self.tree.abort_store(t)
        assert out.ok == (ok and not was_stale)
        assert self.tree.tiers[t.dst_tier].capacity_tokens() == capacity, "settling revoked blocks"
        device_frees = []
        for rel in out.released:
            self._release(rel, device_frees)
        self._free_device(device_frees)

    @rule(ns=st.sampled_from(NAMESPACES), key=keys)
    def begin_load_back(self, ns, key):
        m = self.tree.match(key, ns)
        if not m.loads:
            return
        slots = self._alloc(m.load_len)
        if slots is None:
            return
        m = self.tree.match(key, ns)  # evicting for room may have changed the tree
        if m.load_len != len(slots):
            self.free.update(slots)
            return
        t = self.tree.begin_load_back(m.last_node, slots)
        if t is None:
            self.free.update(slots)
            return
        staged = {}
        for c in t.copies:
            for s, v in zip(c.dst.indices, self._read(c.src_tier, c.src)):
                staged[s] = v
        assert sorted(staged) == sorted(slots)
        self.tickets.append((t, staged, ns, key[: m.prefix_len]))

    @precondition(lambda self: self.tickets)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def finish_load_back(self, i, ok):
        t, staged, ns, prefix = self.tickets.pop(i % len(self.tickets))
        was_stale = t.stale
        out = self.tree.complete_load_back(t) if ok else self.tree.abort_load_back(t)
        assert out.ok == (ok and not was_stale)
        if out.ok:
            self.dev.update(staged)
            self._check_match(ns, prefix, self.tree.match(prefix, ns))
            self.tree.unlock(out.last_node)
        else:
            assert sorted(out.device_indices_to_free) == sorted(staged)
            self.free.update(staged)

    @precondition(lambda self: self.tree.donor is not None)
    @rule(donor=st.sampled_from(["a", "b"]), blocks=st.integers(1, 12),
          hazard=st.sampled_from([0.0, 0.3, 0.9]))
    def add_lease(self, donor, blocks, hazard):
        if (donor, 0) in self.tree.donor.leases:
            return
        self.epochs[donor] += 1
        self.tree.donor.add_lease(donor, 0, self.epochs[donor], blocks, hazard)

    @precondition(lambda self: self.tree.donor is not None and self.tree.donor.leases)
    @rule(data=st.data(), whole=st.booleans())
    def revoke(self, data, whole):
        donor, lease_id = data.draw(st.sampled_from(sorted(self.tree.donor.leases)))
        lease = self.tree.donor.leases[(donor, lease_id)]
        mine = lambda r: (r.donor, r.lease, r.epoch) == (donor, lease_id, lease.epoch)  # noqa: E731
        if whole:
            gone = None
        else:
            owned = list(lease.free_blocks) + [
                k[3] for k in self.blocks if k[:3] == (donor, lease_id, lease.epoch)] + [
                b for t in self.stores if t.dst_tier == DONOR and t.dst is not None
                and mine(t.dst) for b in t.dst.blocks]
            gone = data.draw(st.sets(st.sampled_from(sorted(owned)), min_size=1)) if owned else None
        revoked = {k for k in self.blocks if k[:2] == (donor, lease_id)
                   and (gone is None or k[3] in gone)}
        dev, host, _ = self._held()
        before = dict(self.blocks)
        stale_before = {t.ticket_id for t, *_ in self.tickets if t.stale}
        stores_hit = {t.ticket_id for t in self.stores if t.dst_tier == DONOR and t.dst is not None
                      and mine(t.dst) and (gone is None or set(t.dst.blocks) & gone)}
        stores_stale = {t.ticket_id for t in self.stores if t.stale}
        r = self.tree.revoke(donor, lease_id, gone)
        # A residency is dropped whole when any of its blocks is revoked (contract); prefixes
        # held only by such residencies lose their last copy.
        direct = [rel.residency for rel in r.released if rel.tier == DONOR and any(
            (rel.residency.donor, rel.residency.lease, rel.residency.epoch, b) in revoked
            for b in rel.residency.blocks)]
        only_there = {before[(d.donor, d.lease, d.epoch, b)][-1] for d in direct for b in d.blocks}
        only_there = {c for c in only_there if c not in dev and c not in host}
        device_frees = []
        for rel in r.released:
            self._release(rel, device_frees)
        assert not device_frees, "a revoke never releases device KV (device nodes have no holes)"
        assert not (revoked & set(self.blocks)), "KV still held on revoked blocks"
        for lp in r.lost:
            first_lost = (lp.namespace, tuple(lp.tokens[: lp.still_cached + self.page]))
            assert first_lost in only_there, "revoke reported a prefix that still has a copy"
            assert self.tree.match(lp.tokens, lp.namespace).prefix_len == lp.still_cached
        # Every prefix that lost its last copy lies in a reported lost subtree.
        for ns, p in only_there:
            assert any(ns == lp.namespace and len(p) > lp.still_cached
                       and p[: lp.still_cached + 1] == tuple(lp.tokens[: lp.still_cached + 1])
                       for lp in r.lost), f"unreported loss {p}"
        for t, *_ in self.tickets:
            if t.ticket_id in r.stale_tickets:
                assert t.stale and t.ticket_id not in stale_before
        for t in self.stores:
            fresh = t.ticket_id not in stores_stale
            assert t.stale == (t.ticket_id in stores_hit or not fresh), "store staleness wrong"
            assert (t.ticket_id in r.stale_tickets) == (t.ticket_id in stores_hit and fresh)

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def integrity(self):
        if not hasattr(self, "tree"):
            return
        self.tree.check_integrity()
        in_flight = sum(len(s) for _, s, *_ in self.tickets)
        assert len(self.free) + self.tree.device_size() + in_flight == DEVICE_SLOTS, "slot leak"
        assert len(self.dev) == self.tree.device_size()
        assert not (self.free & set(self.dev)), "a free slot still holds tree KV"
        held = sum(len(p) for p in self.blocks.values())
        reserved = Counter()  # blocks of stores in flight: allocated, not written yet
        for t in self.stores:
            if t.dst is not None:
                reserved[t.dst_tier] += t.dst.num_tokens(self.page)
        assert held + reserved[DONOR] == self.tree.tier_size(DONOR)
        assert len(self.host) + reserved[HOST] == self.tree.tier_size(HOST)
        assert self.tree.stores_in_flight() == len(self.stores)
        for node, _ns, _prefix in self.locks:
            assert DEVICE in node.res, "a locked node left the device"


STEPS = {"n": 0}


class CountedMachine(TieredTreeMachine):
    """Counts the steps actually run (each step is followed by the invariant check)."""

    @invariant()
    def count(self):
        STEPS["n"] += 1


def test_tiered_tree_state_machine_2000_steps():
    """Invariant: every check above holds after every step, over at least 2,000 random steps."""
    STEPS["n"] = 0
    run_state_machine_as_test(
        CountedMachine,
        settings=settings(max_examples=200, stateful_step_count=50, deadline=None),
    )
    assert STEPS["n"] >= 2000, f"only {STEPS['n']} steps ran"
