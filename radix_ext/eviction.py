"""`Eviction`: giving up device tokens, each victim demoted to a lower tier or dropped."""

from __future__ import annotations

import heapq
from typing import Any, Callable, Iterator

from radix_ext.departures import UNDECIDED, Departures
from radix_ext.node import Node
from radix_ext.residency import DEVICE, DONOR, HOST
from radix_ext.results import EvictionPlan, StoreTicket
from radix_ext.room import EvictionRun, Room
from radix_ext.store import Store
from radix_ext.structure import Structure
from radix_ext.tree_config import TreeConfig


class Eviction:
    """Device eviction under the configured policies; stateless between calls (a running
    eviction's state is its `EvictionRun`)."""

    def __init__(self, config: TreeConfig, nodes: Structure, departures: Departures,
                 store: Store, room: Room, eviction: Any, demotion: Any):
        self._config = config
        self._nodes = nodes
        self._departures = departures
        self._store = store
        self._room = room
        self._eviction = eviction
        self._demotion = demotion

    def evict_device(self, num_tokens: int) -> EvictionPlan:
        """Give up at least `num_tokens` device tokens (fewer if not enough are evictable).

        Contract: victims are unlocked, unpinned device leaves (a node whose device children
        are all leaving counts as a leaf), in the eviction policy's order. A victim that already
        has a lower-tier copy just leaves the device (unless the demotion policy finds a better
        place: cost-aware replaces a copy on a flakier donor). Otherwise it is demoted to the
        first target of the demotion policy with room (donor when leased capacity is free, else
        host, by default), making room there if needed, and dropped (with its now unreachable
        subtree) when no tier takes it. A demotion is a `StoreTicket`: the victim stays on the
        device, pinned, until the caller settles it (see `store.py`); a victim with leaving
        children leaves (or is dropped) once they have. Nothing locked or in flight is touched.
        """
        s = self._nodes
        pol = self._eviction
        run = EvictionRun(drops=[] if self._config.name_donor_drops else None)
        leaves, leaving = s.leaves, s.leaving
        heap = [(pol.device_priority(x, s), x.id, x) for x in leaves]
        heapq.heapify(heap)
        steps: list = []
        evicted = demoted = dropped = 0
        donor_over_host = self._config.donor_over_host and s.donor is not None
        while evicted < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            if x not in leaves:
                continue
            run.hint = num_tokens - evicted  # what this call may still demote
            dev = x.res[DEVICE]
            had_copy = len(x.res) > 1
            self._departures.depart(x)
            n = len(x.key)
            evicted += n
            parent = x.parent
            if had_copy and not self._demotion.make_room_first:
                if donor_over_host and DONOR not in x.res and HOST in x.res:
                    self._place(run, x, dev, DONOR, (), steps, None)  # free room only
                demoted += n
            elif self._demote(run, x, dev, steps):
                demoted += n
            elif had_copy:
                demoted += n  # kept the lower copy it had: no better target took it
            else:
                dropped += n
            if leaving[x] is UNDECIDED:  # no store: leaves now, or once its children have
                self._departures.decide(x, steps)
            s.refresh_leaf(parent)
            if parent in leaves:
                heapq.heappush(heap, (pol.device_priority(parent, s), parent.id, parent))
        if run.cancelled:  # stores cancelled to make room in this pass never reach the caller
            gone = set(run.cancelled)
            steps = [x for x in steps if type(x) is not StoreTicket or x not in gone]
        return EvictionPlan(evicted, demoted, dropped, tuple(steps), tuple(run.drops or ()))

    def _demote(self, run: EvictionRun, x: Node, dev: Any, steps: list) -> bool:
        """Start copying `x` (leaving the device, from `dev`) into a lower tier; False if none
        takes it. A copy `x` already has elsewhere is replaced only by a cheaper one
        (cost-aware)."""
        s = self._nodes
        demotion = self._demotion
        targets = [(t, p) for t, p in demotion.targets(x, s) if t in s.tiers]
        if demotion.make_room_first:
            have = min((s.cost.residency_cost(t, r, s) for t, r in x.res.items()
                        if t != DEVICE), default=s.cost.recompute)
            # Per target, cheapest first: free room, else room made by dropping only copies
            # worth less than what falling through (to later targets, or to the copy `x` has)
            # would lose on `x`.
            for i, (t, p) in enumerate(targets):
                if demotion.cost_of(t, p) >= have:
                    return False
                if self._place(run, x, dev, t, p, steps, None):
                    return True
                bar = demotion.room_bar(x, s, t, p, targets[i + 1 :], have)
                if bar > 0 and self._place(run, x, dev, t, p, steps, bar):
                    return True
            return False
        for bar in (None, float("inf")):  # free room in any target first, then make room
            for t, p in targets:
                if self._place(run, x, dev, t, p, steps, bar):
                    return True
        return False

    def _place(self, run: EvictionRun, x: Node, dev: Any, tier: str, pref: Any, steps: list,
               bar: Any) -> bool:
        """Start a store of `x` into `tier`; with `bar`, first make room there by dropping
        copies whose policy priority is below it (None: use free room only). A copy `x` has in
        `tier` already is replaced when the store completes."""
        n = len(x.key)
        t = self._nodes.tiers[tier]
        res = t.alloc(n, pref)
        if res is None and bar is not None:
            for scope in self._room_scopes(t, pref, n):
                steps.extend(self._room.make(tier, n, run, within=scope, bar=bar,
                                             exclude=x).steps)
                res = t.alloc(n, scope)
                if res is not None:
                    break
        if res is None:
            return False
        run.fresh[x] = self._store.begin(x, dev, tier, res, steps)
        return True

    def _room_scopes(self, t: Any, pref: Any, n: int) -> list:
        """Where room for an `n`-token copy may be made: a copy lives in one lease, so in a donor
        tier without a preference each lease big enough, most free blocks first (room made
        across all leases together can add up to `n` while no single lease holds it); else the
        preference (or the whole tier) when it is big enough."""
        page = self._nodes.page_size
        leases = getattr(t, "leases", None)
        if leases is not None and not pref and len(leases) > 1:
            fits = [x for x in leases.values() if x.num_blocks * page >= n]
            return [(x,) for x in sorted(fits, key=lambda x: -len(x.free_blocks))]
        if pref and leases is not None:
            cap = sum(x.num_blocks for x in pref) * page
        else:
            cap = t.capacity_tokens()
        return [pref] if cap >= n else []

    # ---- the eviction order, without evicting ---------------------------------------------------

    def demotion_volume(self, num_tokens: int) -> int:
        """Tokens `evict_device(num_tokens)` would demote into lower tiers now: its victims are
        whole leaves in the eviction policy's order (more than `num_tokens` when the last is
        larger than what is left), and those that already have a lower copy need no room there.
        Changes nothing."""
        leaving = self._nodes.leaving

        def leaf(x: Node, gone: set) -> bool:
            """As `evict_device` finds leaves: unheld, not leaving, device children gone or
            leaving."""
            return (not x.lock_ref and not x.pins and x not in leaving
                    and all(c in gone or c in leaving or DEVICE not in c.res
                            for c in x.children.values()))

        evicted = demoted = 0
        for x in self.order(leaf):
            if evicted >= num_tokens:
                break
            evicted += len(x.key)
            demoted += len(x.key) if len(x.res) == 1 else 0
        return demoted

    def order(self, is_leaf: Callable[[Node, set], bool]) -> Iterator[Node]:
        """Device leaves for which `is_leaf(x, taken)` holds, in the eviction policy's order,
        as an eviction would take them without changing the tree: each one yielded counts as
        taken, and its parent joins once `is_leaf(parent, taken)` holds. The consumer may split
        a yielded node (its head becomes the parent considered next)."""
        s = self._nodes
        pol = self._eviction
        taken: set = set()
        heap = [(pol.device_priority(x, s), x.id, x) for x in s.leaves if is_leaf(x, taken)]
        heapq.heapify(heap)
        while heap:
            _, _, x = heapq.heappop(heap)
            yield x
            taken.add(x)
            p = x.parent
            if p is not s.root and is_leaf(p, taken):
                heapq.heappush(heap, (pol.device_priority(p, s), p.id, p))
