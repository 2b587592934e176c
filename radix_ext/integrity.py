"""`check_integrity`: every invariant of `RadixTree`, checked from scratch (mixin)."""

from __future__ import annotations

from radix_ext.residency import DEVICE
from radix_ext.slot_runs import values


class IntegrityMixin:
    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant is broken. O(size of the tree); for tests.

        Checks: structure (parent links, child keys, page-aligned non-empty keys), residency
        lengths, device prefix-closure, no node resident nowhere, lock counts balanced, pins match
        the in-flight tickets, exchanges and leaving nodes, stores in flight cover device nodes
        exactly, leaving nodes are unlocked with only leaving device children, device sizes add
        up, every index owned once in every tier (stores' reserved blocks included), and the
        cached leaf and tier-membership sets.
        """
        page = self.page_size
        root = self.root
        assert root.lock_ref == 1 and not root.res and len(root.key) == 0, "root corrupted"
        pins_expected: dict = {}
        for t in self._tickets.values():
            for p in [] if t.stale else self._ticket_path(t):
                pins_expected[p] = pins_expected.get(p, 0) + 1
        lower: dict = {name: [] for name in self.tiers}
        for res in self._reserved.values():
            lower[res.tier].append(res)
        for t in self._stores.values():
            path = self._store_path(t)
            assert sum(len(p.key) for p in path) == t.num_tokens, (
                f"store {t.ticket_id} lost its nodes")
            for p in path:
                assert DEVICE in p.res, (
                    f"store {t.ticket_id}: {p} left the device before it settled")
                pins_expected[p] = pins_expected.get(p, 0) + 1
            assert t.stale or t.dst is not None, f"store {t.ticket_id} has no destination"
            if t.dst is not None:
                lower[t.dst_tier].append(t.dst)
        for x in self._leaving:
            pins_expected[x] = pins_expected.get(x, 0) + 1
        sides: dict = {}
        for t in self._exchanges.values():
            for x in (*t.hit, *t.victims):
                sides[x] = t
                pins_expected[x] = pins_expected.get(x, 0) + 1
            assert not self._attached(t.hit[-1]) or all(DEVICE in x.res for x in t.hit), (
                f"exchange {t.ticket_id}: its hit left the device before it settled")
        assert sides == self._exchanging, "nodes of exchanges in flight drifted"
        dev_indices: list = []
        leaving = 0
        members: dict = {name: set() for name in self.tiers}
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
                    assert tier in self.tiers, f"{x}: residency in unconfigured tier {tier}"
                    lower[tier].append(res)
                    members[tier].add(x)
            locks = x.direct_locks + sum(c.lock_ref for c in x.children.values())
            assert x.direct_locks >= 0 and x.lock_ref == locks, (
                f"{x}: lock_ref {x.lock_ref} != {locks}")
            assert x.pins == pins_expected.get(x, 0), f"{x}: pins {x.pins} != in-flight loads"
            on_dev = DEVICE in x.res
            if x in self._leaving:
                assert on_dev and x.lock_ref == 0, f"{x}: leaving but locked or off the device"
                assert all(c in self._leaving for c in x.children.values() if DEVICE in c.res), (
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
                        DEVICE in c.res and c not in self._leaving for c in x.children.values()):
                    leaves.add(x)
            else:
                assert x.lock_ref == 0, f"{x}: locked but not on the device"
            for c in x.children.values():
                assert c.parent is x, f"{c}: parent link broken"
                stack.append(c)
        assert len(set(dev_indices)) == len(dev_indices), "a device index is owned twice"
        assert seen.issuperset(self._leaving), "a leaving node is no longer in the tree"
        for t in self._stores.values():
            assert seen.issuperset(self._store_path(t)), f"store {t.ticket_id}: nodes left the tree"
        for x, t in self._leaving.items():
            assert t is None or (self._stores.get(t.ticket_id) is t and x in self._store_path(t)), (
                f"{x} waits on a store that does not cover it")
        kept = (self.dev_evictable, self.dev_protected, self.dev_leaving)
        assert (evictable, protected, leaving) == kept, (
            f"device sizes drifted: counted {(evictable, protected, leaving)}, kept {kept}")
        assert leaves == self._dev_leaves, "evictable-leaf set drifted"
        for name, tier in self.tiers.items():
            tier.check_integrity(lower[name])
            assert members[name] == self._in_tier[name], f"{name} membership set drifted"
        for t in self._tickets.values():
            assert t.anchor is root or t.anchor.direct_locks > 0, (
                f"ticket {t.ticket_id} lost its lock")
