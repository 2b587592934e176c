"""Eviction from the device and room-making in lower tiers (mixin of `RadixTree`)."""

from __future__ import annotations

import heapq
from typing import Any

from radix_ext.residency import DEVICE, DONOR, HOST
from radix_ext.results import (
    EvictionPlan,
    MakeRoomResult,
    Released,
    StoreTicket,
    Transfer,
    Unrescued,
)
from radix_ext.store import UNDECIDED

_DEPTH = {DEVICE: 0, DONOR: 1, HOST: 2}  # the tier order, fastest first


class TieringMixin:
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
        pol = self.eviction
        self._fresh = {}
        self._drops = [] if self.config.name_donor_drops else None
        heap = [(pol.device_priority(x, self), x.id, x) for x in self._dev_leaves]
        heapq.heapify(heap)
        steps: list = []
        evicted = demoted = dropped = 0
        while evicted < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            if x not in self._dev_leaves:
                continue
            self._room_hint = num_tokens - evicted  # what this call may still demote
            dev = x.res[DEVICE]
            had_copy = len(x.res) > 1
            self._depart(x)
            n = len(x.key)
            evicted += n
            parent = x.parent
            if had_copy and not self.demotion.make_room_first:
                if (self.config.donor_over_host and self.donor is not None
                        and DONOR not in x.res and HOST in x.res):
                    self._place(x, dev, DONOR, (), steps, None)  # free room only
                demoted += n
            elif self._demote(x, dev, steps):
                demoted += n
            elif had_copy:
                demoted += n  # kept the lower copy it had: no better target took it
            else:
                dropped += n
            if self._leaving[x] is UNDECIDED:  # no store: leaves now, or once its children have
                self._leaving[x] = None
                self._leave(x, steps)
            self._refresh_leaf(parent)
            if parent in self._dev_leaves:
                heapq.heappush(heap, (pol.device_priority(parent, self), parent.id, parent))
        self._room_hint = 0
        self._fresh = {}
        drops, self._drops = tuple(self._drops or ()), None
        # stores cancelled to make room in this pass never reach the caller
        steps = [s for s in steps if type(s) is not StoreTicket or s.ticket_id in self._stores]
        return EvictionPlan(evicted, demoted, dropped, tuple(steps), drops)

    def _demote(self, x: Any, dev: Any, steps: list) -> bool:
        """Start copying `x` (leaving the device, from `dev`) into a lower tier; False if none
        takes it. A copy `x` already has elsewhere is replaced only by a cheaper one
        (cost-aware)."""
        targets = [(t, p) for t, p in self.demotion.targets(x, self) if t in self.tiers]
        if self.demotion.make_room_first:
            have = min((self.cost.residency_cost(t, r, self) for t, r in x.res.items()
                        if t != DEVICE), default=self.cost.recompute)
            # Per target, cheapest first: free room, else room made by dropping only copies
            # worth less than what falling through (to later targets, or to the copy `x` has)
            # would lose on `x`.
            for i, (t, p) in enumerate(targets):
                if self.demotion.cost_of(t, p) >= have:
                    return False
                if self._place(x, dev, t, p, steps, None):
                    return True
                bar = self.demotion.room_bar(x, self, t, p, targets[i + 1 :], have)
                if bar > 0 and self._place(x, dev, t, p, steps, bar):
                    return True
            return False
        for bar in (None, float("inf")):  # free room in any target first, then make room
            for t, p in targets:
                if self._place(x, dev, t, p, steps, bar):
                    return True
        return False

    def _place(self, x: Any, dev: Any, tier: str, pref: Any, steps: list, bar: Any) -> bool:
        """Start a store of `x` into `tier`; with `bar`, first make room there by dropping
        copies whose policy priority is below it (None: use free room only). A copy `x` has in
        `tier` already is replaced when the store completes."""
        n = len(x.key)
        t = self.tiers[tier]
        res = t.alloc(n, pref)
        if res is None and bar is not None:
            for scope in self._room_scopes(t, pref, n):
                steps.extend(self._make_room(tier, n, within=scope, bar=bar, exclude=x).steps)
                res = t.alloc(n, scope)
                if res is not None:
                    break
        if res is None:
            return False
        self._begin_store(x, dev, tier, res, steps)
        return True

    def _alloc_or_make_room(self, tier: str, n: int, released: list) -> Any:
        """An `n`-token residency in `tier`, from free room or else from room made by dropping
        its least valuable droppable copies (appended to `released`: nothing is moved, its
        callers copy nothing between lower tiers); None when none is left. Pinned nodes keep
        their copies."""
        t = self.tiers[tier]
        res = t.alloc(n)
        if res is None:
            released.extend(s for s in self._make_room(tier, n, chunk=False, move=False).steps
                            if type(s) is Released)
            res = t.alloc(n)
        return res

    def _room_scopes(self, t: Any, pref: Any, n: int) -> list:
        """Where room for an `n`-token copy may be made: a copy lives in one lease, so in a donor
        tier without a preference each lease big enough, most free blocks first (room made
        across all leases together can add up to `n` while no single lease holds it); else the
        preference (or the whole tier) when it is big enough."""
        leases = getattr(t, "leases", None)
        if leases is not None and not pref and len(leases) > 1:
            fits = [x for x in leases.values() if x.num_blocks * self.page_size >= n]
            return [(x,) for x in sorted(fits, key=lambda x: -len(x.free_blocks))]
        if pref and leases is not None:
            cap = sum(x.num_blocks for x in pref) * self.page_size
        else:
            cap = t.capacity_tokens()
        return [pref] if cap >= n else []

    def make_room(self, tier: str, num_tokens: int) -> MakeRoomResult:
        """Free at least `num_tokens` of `tier` if its unpinned copies allow it.

        Contract: drops (or moves down to another tier with free room) the lower-tier
        copies the eviction policy values least, among copies whose node keeps another copy or
        has no children (so no prefix is left with a hole). Pinned nodes are untouched.
        """
        return self._make_room(tier, num_tokens, chunk=False)

    def _make_room(self, tier: str, need: int, chunk: bool = True, within=(),
                   bar: float = float("inf"), exclude: Any = None,
                   move: bool = True) -> MakeRoomResult:
        """`within`: donor leases to make room in (all when empty); `bar`: drop only copies whose
        policy priority is below it; `exclude`: a node whose copies stay; `move`: a copy pushed
        out may cascade to another tier (`_cascade`), else it is dropped."""
        t = self.tiers[tier]
        page = self.page_size
        if within:
            keys = {lease.key for lease in within}
            cap = sum(lease.num_blocks for lease in within) * page
            avail = sum(len(lease.free_blocks) for lease in within) * page
        else:
            keys, cap, avail = None, t.capacity_tokens(), t.available_tokens()
        # Free a chunk at once (at least what the current eviction may still demote):
        # candidates are found by a scan, so amortise it.
        goal = max(need, max(cap // 32, self._room_hint) if chunk else 0) - avail
        if goal <= 0:
            return MakeRoomResult()
        pol = self.eviction
        members = self._in_tier[tier]
        # Nothing below `bar` at the last scan, and nothing changed since: skip the scan.
        floor_key = (tier, frozenset(keys) if keys else None)
        floor = self._room_floor.get(floor_key)
        state = (self.clock, len(members), self.dev_evictable + self.dev_protected)
        if floor is not None and floor[0] == state and bar <= floor[1]:
            return MakeRoomResult()
        # This scan runs on most evictions once the tier is full: keep its loop body lean.
        priority = pol.tier_priority
        heap = []
        lowest = float("inf")
        for x in members:
            # droppable: unpinned, not excluded, and a leaf or a node with another copy
            if x.pins or x is exclude or (x.children and len(x.res) == 1):
                continue
            if keys is not None and (x.res[tier].donor, x.res[tier].lease) not in keys:
                continue
            prio = priority(x, tier, self)
            if prio < lowest:
                lowest = prio
            if prio < bar:
                heap.append((prio, x.id, x))
        for x in self._fresh:
            dst = self._fresh_candidate(x, tier, keys, exclude)
            if dst is not None:
                prio = priority(x, tier, self, dst)
                if prio < lowest:
                    lowest = prio
                if prio < bar:
                    heap.append((prio, x.id, x))
        if not heap:
            self._room_floor[floor_key] = (state, lowest)
            return MakeRoomResult()
        heapq.heapify(heap)
        steps: list = []
        freed = 0
        while freed < goal and heap:
            prio, _, x = heapq.heappop(heap)
            parent = x.parent
            dst = self._fresh_candidate(x, tier, keys, exclude)
            if dst is not None:
                freed += dst.num_tokens(page)
                gone = self._cancel_store(self._fresh[x], steps)
            else:
                if x not in members or x.pins or not (len(x.res) > 1 or not x.children):
                    continue
                res = self._pop_res(x, tier)
                freed += res.num_tokens(page)
                if not x.res and move:
                    self._cascade(x, tier, res, steps, prio)
                t.free(res)
                steps.append(Released(tier, res))
                gone = not x.res
                if gone:
                    del parent.children[x.ck]
                    self._refresh_leaf(parent)
            if not gone:
                continue
            dst = self._fresh_candidate(parent, tier, keys, exclude)
            if dst is not None or (parent in members and not parent.pins and not parent.children
                                   and (keys is None or (parent.res[tier].donor,
                                                         parent.res[tier].lease) in keys)):
                prio = pol.tier_priority(parent, tier, self, dst)
                if prio < bar:
                    heapq.heappush(heap, (prio, parent.id, parent))
        return MakeRoomResult(tuple(steps), freed)

    def _fresh_candidate(self, x: Any, tier: str, keys: Any, exclude: Any) -> Any:
        """The destination in `tier` of a store begun by the running eviction for `x`, if making
        room may drop it (else None). Its copy was never handed out: dropping it cancels the
        store, as a one-phase eviction dropped the fresh copy. The same rule as for copies held:
        a node keeps a copy that no other copy covers while it has children."""
        ticket = self._fresh.get(x)
        if ticket is None or ticket.dst_tier != tier or x is exclude:
            return None
        if not (len(x.res) > 1 or not x.children):  # x.res: its device copy and any others
            return None
        dst = ticket.dst
        if keys is not None and (dst.donor, dst.lease) not in keys:
            return None
        return dst

    def _cascade(self, x: Any, tier: str, res: Any, steps: list, value: float) -> None:
        """A copy pushed out of `tier` (its node's only copy; `value` its policy priority there)
        moves on, per `TreeConfig.cascade`:
        - "any": to the first other tier, in demotion order, with free room (never sideways to
          another lease of the same tier: a copy that hops to a flakier donor takes its whole
          subtree down with it when that donor reclaims);
        - "down": to the first tier below `tier` (donor -> host) with free room, else with room
          made there by dropping copies valued below `value` (as a demotion into a full host);
        - "off": nowhere.
        Else it is dropped (a donor copy dropped by `evict_device` is named in its plan's
        `dropped_donor` with `TreeConfig.name_donor_drops`). A move is a `Transfer` step naming
        the node."""
        if self.config.cascade != "off" and self._move_on(x, tier, res, steps, value):
            return
        if tier == DONOR and self._drops is not None:
            ns, tokens = self.prefix_of(x)
            self._drops.append(Unrescued(ns, tokens, len(tokens) - len(x.key), res))

    def _move_on(self, x: Any, tier: str, res: Any, steps: list, value: float) -> bool:
        """`_cascade`'s move, per its mode; whether `x` found a place."""
        mode = self.config.cascade
        n = len(x.key)
        for target, pref in self.demotion.targets(x, self):
            if target == tier or target not in self.tiers:
                continue
            if mode == "down" and _DEPTH[target] <= _DEPTH[tier]:
                continue
            moved = self.tiers[target].alloc(n, pref)
            if moved is None and mode == "down":
                steps.extend(self._make_room(target, n, chunk=False, bar=value,
                                             exclude=x).steps)
                moved = self.tiers[target].alloc(n, pref)
            if moved is not None:
                self._add_res(x, moved)
                steps.append(Transfer(tier, res, target, moved, x))
                return True
        return False

    def _remove_subtree(self, x: Any, released: list) -> list:
        """Detach `x` and everything below it, releasing every residency; returns the nodes."""
        parent = x.parent
        del parent.children[x.ck]
        gone = []
        stack = [x]
        while stack:
            y = stack.pop()
            gone.append(y)
            for tier in list(y.res):
                res = self._pop_res(y, tier)
                if tier != DEVICE:
                    self.tiers[tier].free(res)
                released.append(Released(tier, res))
            stack.extend(y.children.values())
        self._refresh_leaf(parent)
        return gone
