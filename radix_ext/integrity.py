"""`Integrity`: every invariant of `RadixTree`, checked from scratch."""

from __future__ import annotations

from radix_ext.exchange import Exchange
from radix_ext.fetched import Fetched
from radix_ext.loadback import LoadBack
from radix_ext.residency import DEVICE
from radix_ext.slot_runs import values
from radix_ext.store import Store
from radix_ext.structure import Structure


class Integrity:
    """Reads the books of `Structure` and what each holder of tickets has in flight (through
    their read-only views); changes nothing."""

    def __init__(self, nodes: Structure, loads: LoadBack, stores: Store, exchanges: Exchange,
                 fetched: Fetched):
        self._nodes = nodes
        self._loads = loads
        self._stores = stores
        self._exchanges = exchanges
        self._fetched = fetched

    def check(self) -> None:
        """Raise AssertionError if any invariant is broken. O(size of the tree); for tests.

        Checks: structure (parent links, child keys, page-aligned non-empty keys), residency
        lengths, device prefix-closure, no node resident nowhere, lock counts balanced, pins match
        the in-flight tickets, exchanges and leaving nodes, stores in flight cover device nodes
        exactly, leaving nodes are unlocked with only leaving device children, device sizes add
        up, every index owned once in every tier (stores' reserved blocks included), and the
        cached leaf and tier-membership sets.
        """
        s = self._nodes
        page = s.page_size
        root = s.root
        leaving_nodes = s.leaving
        stores = {t.ticket_id: t for t in self._stores.tickets()}
        assert root.lock_ref == 1 and not root.res and len(root.key) == 0, "root corrupted"
        pins_expected: dict = {}
        for t in self._loads.tickets():
            for p in [] if t.stale else self._loads.path(t):
                pins_expected[p] = pins_expected.get(p, 0) + 1
        lower: dict = {name: [] for name in s.tiers}
        for res in self._fetched.reservations():
            lower[res.tier].append(res)
        for t in stores.values():
            path = self._stores.path(t)
            assert sum(len(p.key) for p in path) == t.num_tokens, (
                f"store {t.ticket_id} lost its nodes")
            for p in path:
                assert DEVICE in p.res, (
                    f"store {t.ticket_id}: {p} left the device before it settled")
                pins_expected[p] = pins_expected.get(p, 0) + 1
            assert t.stale or t.dst is not None, f"store {t.ticket_id} has no destination"
            if t.dst is not None:
                lower[t.dst_tier].append(t.dst)
        for x in leaving_nodes:
            pins_expected[x] = pins_expected.get(x, 0) + 1
        sides: dict = {}
        for t in self._exchanges.tickets():
            for x in (*t.hit, *t.victims):
                sides[x] = t
                pins_expected[x] = pins_expected.get(x, 0) + 1
            assert not s.attached(t.hit[-1]) or all(DEVICE in x.res for x in t.hit), (
                f"exchange {t.ticket_id}: its hit left the device before it settled")
        assert sides == self._exchanges.sides, "nodes of exchanges in flight drifted"
        dev_indices: list = []
        leaving = 0
        members: dict = {name: set() for name in s.tiers}
        leaves = set()
        seen = set()
        evictable = protected = 0
        stack = list(root.children.values())
        for c in stack:
            assert c.parent is root, f"{c} has a wrong parent"
        while stack:
            x = stack.pop()
            seen.add(x)
            n = len(x.key)
            assert n > 0 and n % page == 0, f"{x}: key length {n} not a positive page multiple"
            first = x.key[0] if page == 1 else tuple(x.key[:page])
            ck = (x.ck[0], first) if x.parent is root else first
            assert x.ck == ck and x.parent.children.get(x.ck) is x, f"{x}: child key mismatch"
            assert x.res, f"{x} is resident nowhere"
            for tier, res in x.res.items():
                assert res.tier == tier, f"{x}: {res} filed under {tier}"
                assert res.num_tokens(page) == n, f"{x}: {res} does not cover {n} tokens"
                if tier == DEVICE:
                    dev_indices.extend(values(res.indices))
                else:
                    assert tier in s.tiers, f"{x}: residency in unconfigured tier {tier}"
                    lower[tier].append(res)
                    members[tier].add(x)
            locks = x.direct_locks + sum(c.lock_ref for c in x.children.values())
            assert x.direct_locks >= 0 and x.lock_ref == locks, (
                f"{x}: lock_ref {x.lock_ref} != {locks}")
            assert x.pins == pins_expected.get(x, 0), f"{x}: pins {x.pins} != in-flight loads"
            on_dev = DEVICE in x.res
            if x in leaving_nodes:
                assert on_dev and x.lock_ref == 0, f"{x}: leaving but locked or off the device"
                assert all(c in leaving_nodes for c in x.children.values() if DEVICE in c.res), (
                    f"{x}: leaving with a child that stays on the device")
                leaving += n
            elif on_dev:
                if x.lock_ref:
                    protected += n
                else:
                    evictable += n
            if on_dev:
                assert x.parent is root or DEVICE in x.parent.res, f"{x}: on device, parent is not"
                if not x.lock_ref and not x.pins and not any(
                        DEVICE in c.res and c not in leaving_nodes for c in x.children.values()):
                    leaves.add(x)
            else:
                assert x.lock_ref == 0, f"{x}: locked but not on the device"
            for c in x.children.values():
                assert c.parent is x, f"{c}: parent link broken"
                stack.append(c)
        assert len(set(dev_indices)) == len(dev_indices), "a device index is owned twice"
        assert seen.issuperset(leaving_nodes), "a leaving node is no longer in the tree"
        for t in stores.values():
            assert seen.issuperset(self._stores.path(t)), (
                f"store {t.ticket_id}: nodes left the tree")
        for x, t in leaving_nodes.items():
            assert t is None or (stores.get(t.ticket_id) is t and x in self._stores.path(t)), (
                f"{x} waits on a store that does not cover it")
        kept = (s.evictable, s.protected, s.leaving_tokens)
        assert (evictable, protected, leaving) == kept, (
            f"device sizes drifted: counted {(evictable, protected, leaving)}, kept {kept}")
        assert leaves == s.leaves, "evictable-leaf set drifted"
        for name, tier in s.tiers.items():
            tier.check_integrity(lower[name])
            assert members[name] == s.in_tier[name], f"{name} membership set drifted"
        for t in self._loads.tickets():
            assert t.anchor is root or t.anchor.direct_locks > 0, (
                f"ticket {t.ticket_id} lost its lock")
