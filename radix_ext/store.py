"""Two-phase demotion: a node leaves the device only once its store settled (mixin of `RadixTree`).

`evict_device` starts each demotion as a `StoreTicket` and marks its victims *leaving*: a leaving
node keeps its device slots (pinned: not evicted again, not freed, still a device hit) and its
tokens count as neither evictable nor protected. A leaving node's parent may be evicted in the
same pass (its device children are all leaving), so a plan evicts exactly what a one-phase
eviction would. A leaving node actually leaves (its device slots are returned to the caller) when
its own store, if any, has settled and none of its children is still on the device; that keeps
device residency prefix-closed whatever order the caller settles tickets in.

A leaving node stays on the device after all when it is needed there again: `lock` (a request
uses it) or `insert` (a device child appears under it) cancel its departure; a store in flight
for it still completes, as a write-through copy, and holds the node like a lock until then (it
cannot be evicted before its store settles, so it must not count as evictable). Stale tickets
(a revoke took `dst` back) fail on completion exactly like `abort_store`.
"""

from __future__ import annotations

from typing import Any

from radix_ext.residency import DEVICE
from radix_ext.results import Released, StoreOutcome, StoreTicket, Transfer

UNDECIDED = "undecided"  # `_leaving` value of the victim whose fate evict_device is deciding


class StoreMixin:
    def complete_store(self, ticket: StoreTicket) -> StoreOutcome:
        """The copy of `ticket` finished: its lower copy is real now (replacing any older copy
        the nodes had in that tier), and the nodes leave the device unless they were needed there
        again meanwhile. A stale ticket fails like `abort_store`."""
        if ticket.stale:
            return self.abort_store(ticket)
        path = self._close_store(ticket)
        tier = self.tiers[ticket.dst_tier]
        released: list = []
        rest = ticket.dst
        for p in path:
            part, rest = ((rest, None) if p is ticket.node
                          else rest.split(len(p.key), self.page_size))
            if ticket.dst_tier in p.res:  # one copy per tier: the new one replaces a worse one
                old = self._pop_res(p, ticket.dst_tier)
                tier.free(old)
                released.append(Released(ticket.dst_tier, old))
            self._add_res(p, part)
        self._settle(path, released)
        return StoreOutcome(True, tuple(released))

    def abort_store(self, ticket: StoreTicket) -> StoreOutcome:
        """The copy failed or is cancelled: `dst` goes back to its tier's free set (its lease
        keeps the blocks; this is not a revoke). The eviction still happens: the nodes leave the
        device keeping only the copies they already had, and a node left with none is dropped
        with its subtree. A node needed on the device again meanwhile just stays there."""
        path = self._close_store(ticket)
        if ticket.dst is not None:
            self.tiers[ticket.dst_tier].free(ticket.dst)
        released: list = []
        self._settle(path, released)
        return StoreOutcome(False, tuple(released))

    def stores_in_flight(self) -> int:
        return len(self._stores)

    # ---- begin (called by the eviction) ---------------------------------------------------------

    def _begin_store(self, x: Any, dev: Any, tier: str, dst: Any, steps: list) -> None:
        ticket = StoreTicket(self._next_ticket, x, len(x.key), dev, tier, dst,
                             transfer=Transfer(DEVICE, dev, tier, dst))
        self._next_ticket += 1
        self._stores[ticket.ticket_id] = ticket
        self._fresh[x] = ticket  # begun in the running eviction (see `_fresh_candidate`)
        self._leaving[x] = ticket
        x.pins += 1  # the store's pin; the departure holds another
        steps.append(ticket)

    def _cancel_store(self, ticket: StoreTicket, steps: list) -> bool:
        """Making room drops the destination of a store begun in the running eviction: the copy
        moves down to another tier with free room (device to there, directly), else the node
        leaves with the copies it has, or none. Returns whether the node left the tree."""
        x = ticket.node
        del self._stores[ticket.ticket_id]
        del self._fresh[x]
        x.pins -= 1
        self._leaving[x] = None
        self.tiers[ticket.dst_tier].free(ticket.dst)
        if len(x.res) == 1:  # no other copy: one-phase eviction cascaded the fresh copy
            for target, pref in self.demotion.targets(x, self):
                if target != ticket.dst_tier and target in self.tiers:
                    moved = self.tiers[target].alloc(ticket.num_tokens, pref)
                    if moved is not None:
                        self._begin_store(x, ticket.src, target, moved, steps)
                        return False
        parent = x.parent
        self._leave(x, steps)
        return parent.children.get(x.ck) is not x

    def _depart(self, x: Any) -> None:
        """Mark the device leaf `x` leaving (it was unlocked and evictable); until its fate is
        decided it is UNDECIDED, so nothing settles it meanwhile."""
        self._leaving[x] = UNDECIDED
        x.pins += 1
        n = len(x.key)
        self.dev_evictable -= n
        self.dev_leaving += n
        self._dev_leaves.discard(x)

    # ---- departures -----------------------------------------------------------------------------

    def _store_path(self, ticket: StoreTicket) -> list:
        """The nodes `ticket` covers, in path order (one, or more after splits)."""
        path, n, x = [], 0, ticket.node
        while n < ticket.num_tokens:
            path.append(x)
            n += len(x.key)
            x = x.parent
        path.reverse()
        return path

    def _close_store(self, ticket: StoreTicket) -> list:
        if self._stores.pop(ticket.ticket_id, None) is None:
            raise ValueError(f"store ticket {ticket.ticket_id} is not in flight (settled twice?)")
        path = self._store_path(ticket)
        for p in path:
            p.pins -= 1
        for x in self._store_holds.pop(ticket.ticket_id, ()):
            self._release(x)
        return path

    def _settle(self, path: list, released: list) -> None:
        """After a store settled: its nodes leave if nothing else holds them back."""
        for p in path:
            if self._leaving.get(p) is not None:
                self._leaving[p] = None  # its own store is done
            self._refresh_leaf(p)
        self._leave(path[-1], released)

    def _leave(self, x: Any, released: list) -> None:
        """Let `x`, then its leaving ancestors, leave the device while each is ready: its own
        store settled and no child still on the device."""
        while self._leaving.get(x, 0) is None and not self._has_device_child(x):
            parent = x.parent
            dev = self._pop_res(x, DEVICE)  # while still leaving: the size books follow
            del self._leaving[x]
            x.pins -= 1
            released.append(Released(DEVICE, dev))
            if not x.res:
                self._remove_subtree(x, released)
            self._refresh_leaf(parent)
            x = parent

    def _stay(self, x: Any) -> None:
        """Cancel the departure of leaving (so unlocked) `x`; a store in flight for it holds it
        until it settles."""
        ticket = self._leaving.pop(x)
        x.pins -= 1
        n = len(x.key)
        self.dev_leaving -= n
        self.dev_evictable += n
        if ticket is not None and ticket.ticket_id in self._stores:
            self._hold(x)
            self._store_holds.setdefault(ticket.ticket_id, []).append(x)

    def _keep(self, x: Any) -> None:
        """A device child appears under `x`: `x` and its leaving ancestors stay on the device."""
        if x not in self._leaving:
            return
        while x in self._leaving:
            self._stay(x)
            self._refresh_leaf(x)
            x = x.parent
        self._refresh_leaf(x)
