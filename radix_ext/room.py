"""`Room`: making room in a lower tier by dropping (or moving on) its least valuable copies.

Making room scans a tier's copies; it runs on most evictions once a tier is full, so the scan
is amortised (a chunk freed at once) and skipped when nothing changed since a scan found nothing
to drop (`_floor`). During an eviction, room may also be made by dropping the destination of a
store that eviction began (an `EvictionRun` says which): that cancels the store, as a one-phase
eviction dropped the fresh copy.
"""

from __future__ import annotations

import heapq
from typing import Any, Optional

from radix_ext.node import Node
from radix_ext.residency import DEVICE, DONOR, HOST
from radix_ext.results import MakeRoomResult, Released, Transfer, Unrescued
from radix_ext.store import Store
from radix_ext.structure import Structure

_DEPTH = {DEVICE: 0, DONOR: 1, HOST: 2}  # the tier order, fastest first
_INF = float("inf")


class EvictionRun:
    """What a running `evict_device` shares with the room it makes: `fresh`, node -> the store
    it began for it (its destination may still be dropped for room, cancelling the store);
    `cancelled`, those stores cancelled so; `hint`, tokens it may still demote (room is made in
    chunks at least that big); `drops`, the donor copies it dropped, named (None: not named).
    Outside an eviction all are empty."""

    __slots__ = ("fresh", "cancelled", "hint", "drops")

    def __init__(self, drops: Optional[list] = None):
        self.fresh: dict = {}
        self.cancelled: list = []
        self.hint = 0
        self.drops = drops


class Room:
    """Room-making in lower tiers. Own state: the make-room scan cache."""

    def __init__(self, nodes: Structure, store: Store, eviction: Any, demotion: Any,
                 cascade: str):
        self._nodes = nodes
        self._store = store
        self._eviction = eviction
        self._demotion = demotion
        self._cascade_mode = cascade
        self._floor: dict = {}  # (tier, leases) -> (books state, lowest priority) at last scan

    def make_room(self, tier: str, num_tokens: int) -> MakeRoomResult:
        """Free at least `num_tokens` of `tier` if its unpinned copies allow it.

        Contract: drops (or moves down to another tier with free room) the lower-tier
        copies the eviction policy values least, among copies whose node keeps another copy or
        has no children (so no prefix is left with a hole). Pinned nodes are untouched.
        """
        return self.make(tier, num_tokens, EvictionRun(), chunk=False)

    def alloc_or_make_room(self, tier: str, n: int, released: list) -> Any:
        """An `n`-token residency in `tier`, from free room or else from room made by dropping
        its least valuable droppable copies (appended to `released`: nothing is moved, its
        callers copy nothing between lower tiers); None when none is left. Pinned nodes keep
        their copies."""
        t = self._nodes.tiers[tier]
        res = t.alloc(n)
        if res is None:
            steps = self.make(tier, n, EvictionRun(), chunk=False, move=False).steps
            released.extend(s for s in steps if type(s) is Released)
            res = t.alloc(n)
        return res

    def make(self, tier: str, need: int, run: EvictionRun, chunk: bool = True, within=(),
             bar: float = _INF, exclude: Any = None, move: bool = True) -> MakeRoomResult:
        """Free at least `need` tokens of `tier`. `within`: donor leases to make room in (all
        when empty); `bar`: drop only copies whose policy priority is below it; `exclude`: a node
        whose copies stay; `move`: a copy pushed out may cascade to another tier (`_cascade`),
        else it is dropped."""
        s = self._nodes
        t = s.tiers[tier]
        page = s.page_size
        if within:
            keys = {lease.key for lease in within}
            cap = sum(lease.num_blocks for lease in within) * page
            avail = sum(len(lease.free_blocks) for lease in within) * page
        else:
            keys, cap, avail = None, t.capacity_tokens(), t.available_tokens()
        # Free a chunk at once (at least what the current eviction may still demote):
        # candidates are found by a scan, so amortise it.
        goal = max(need, max(cap // 32, run.hint) if chunk else 0) - avail
        if goal <= 0:
            return MakeRoomResult()
        pol = self._eviction
        members = s.in_tier[tier]
        # Nothing below `bar` at the last scan, and nothing changed since: skip the scan.
        floor_key = (tier, frozenset(keys) if keys else None)
        floor = self._floor.get(floor_key)
        state = (s.clock, len(members), s.evictable + s.protected)
        if floor is not None and floor[0] == state and bar <= floor[1]:
            return MakeRoomResult()
        # This scan runs on most evictions once the tier is full: keep its loop body lean.
        priority = pol.tier_priority
        heap = []
        lowest = _INF
        for x in members:
            # droppable: unpinned, not excluded, and a leaf or a node with another copy
            if x.pins or x is exclude or (x.children and len(x.res) == 1):
                continue
            if keys is not None and (x.res[tier].donor, x.res[tier].lease) not in keys:
                continue
            prio = priority(x, tier, s)
            if prio < lowest:
                lowest = prio
            if prio < bar:
                heap.append((prio, x.id, x))
        for x in run.fresh:
            dst = self._fresh_candidate(run, x, tier, keys, exclude)
            if dst is not None:
                prio = priority(x, tier, s, dst)
                if prio < lowest:
                    lowest = prio
                if prio < bar:
                    heap.append((prio, x.id, x))
        if not heap:
            self._floor[floor_key] = (state, lowest)
            return MakeRoomResult()
        heapq.heapify(heap)
        steps: list = []
        freed = 0
        while freed < goal and heap:
            prio, _, x = heapq.heappop(heap)
            parent = x.parent
            dst = self._fresh_candidate(run, x, tier, keys, exclude)
            if dst is not None:
                freed += dst.num_tokens(page)
                ticket = run.fresh.pop(x)
                run.cancelled.append(ticket)
                gone, instead = self._store.cancel(ticket, steps)
                if instead is not None:
                    run.fresh[x] = instead
            else:
                if x not in members or x.pins or not (len(x.res) > 1 or not x.children):
                    continue
                res = s.pop_res(x, tier)
                freed += res.num_tokens(page)
                if not x.res and move:
                    self._cascade(run, x, tier, res, steps, prio)
                t.free(res)
                steps.append(Released(tier, res))
                gone = not x.res
                if gone:
                    del parent.children[x.ck]
                    s.refresh_leaf(parent)
            if not gone:
                continue
            dst = self._fresh_candidate(run, parent, tier, keys, exclude)
            if dst is not None or (parent in members and not parent.pins and not parent.children
                                   and (keys is None or (parent.res[tier].donor,
                                                         parent.res[tier].lease) in keys)):
                prio = pol.tier_priority(parent, tier, s, dst)
                if prio < bar:
                    heapq.heappush(heap, (prio, parent.id, parent))
        return MakeRoomResult(tuple(steps), freed)

    def _fresh_candidate(self, run: EvictionRun, x: Node, tier: str, keys: Any,
                         exclude: Any) -> Any:
        """The destination in `tier` of a store begun by the running eviction for `x`, if making
        room may drop it (else None). Its copy was never handed out: dropping it cancels the
        store, as a one-phase eviction dropped the fresh copy. The same rule as for copies held:
        a node keeps a copy that no other copy covers while it has children."""
        ticket = run.fresh.get(x)
        if ticket is None or ticket.dst_tier != tier or x is exclude:
            return None
        if not (len(x.res) > 1 or not x.children):  # x.res: its device copy and any others
            return None
        dst = ticket.dst
        if keys is not None and (dst.donor, dst.lease) not in keys:
            return None
        return dst

    def _cascade(self, run: EvictionRun, x: Node, tier: str, res: Any, steps: list,
                 value: float) -> None:
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
        if self._cascade_mode != "off" and self._move_on(run, x, tier, res, steps, value):
            return
        if tier == DONOR and run.drops is not None:
            ns, tokens = self._nodes.prefix_of(x)
            run.drops.append(Unrescued(ns, tokens, len(tokens) - len(x.key), res))

    def _move_on(self, run: EvictionRun, x: Node, tier: str, res: Any, steps: list,
                 value: float) -> bool:
        """`_cascade`'s move, per its mode; whether `x` found a place."""
        s = self._nodes
        mode = self._cascade_mode
        n = len(x.key)
        for target, pref in self._demotion.targets(x, s):
            if target == tier or target not in s.tiers:
                continue
            if mode == "down" and _DEPTH[target] <= _DEPTH[tier]:
                continue
            moved = s.tiers[target].alloc(n, pref)
            if moved is None and mode == "down":
                steps.extend(self.make(target, n, run, chunk=False, bar=value, exclude=x).steps)
                moved = s.tiers[target].alloc(n, pref)
            if moved is not None:
                s.add_res(x, moved)
                steps.append(Transfer(tier, res, target, moved, x))
                return True
        return False
