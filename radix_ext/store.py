"""`Store`: two-phase demotion; a node leaves the device only once its store settled.

`evict_device` starts each demotion as a `StoreTicket` (`begin`); its victim is leaving (see
`departures.py`) and pinned by the store until the caller settles the ticket with `complete`
(the lower copy is real now) or `abort` (it is not). Stale tickets (a revoke took `dst` back,
`revoke_dst`) fail on completion exactly like `abort`.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable, Iterator, Optional

from radix_ext.departures import Departures
from radix_ext.node import Node
from radix_ext.residency import DEVICE, DONOR, DonorResidency
from radix_ext.results import Released, StoreOutcome, StoreTicket, Transfer
from radix_ext.structure import Structure


class Store:
    """Stores in flight, by ticket id (ids drawn from the tree's shared counter)."""

    def __init__(self, nodes: Structure, departures: Departures, demotion: Any,
                 ticket_ids: Iterator[int]):
        self._nodes = nodes
        self._departures = departures
        self._demotion = demotion
        self._ids = ticket_ids
        self._tickets: dict[int, StoreTicket] = {}

    def complete(self, ticket: StoreTicket) -> StoreOutcome:
        """The copy of `ticket` finished: its lower copy is real now (replacing any older copy
        the nodes had in that tier), and the nodes leave the device unless they were needed there
        again meanwhile. A stale ticket fails like `abort_store`."""
        if ticket.stale:
            return self.abort(ticket)
        s = self._nodes
        path = self._close(ticket)
        tier = s.tiers[ticket.dst_tier]
        released: list = []
        rest = ticket.dst
        for p in path:
            part, rest = ((rest, None) if p is ticket.node
                          else rest.split(len(p.key), s.page_size))
            if ticket.dst_tier in p.res:  # one copy per tier: the new one replaces a worse one
                old = s.pop_res(p, ticket.dst_tier)
                tier.free(old)
                released.append(Released(ticket.dst_tier, old))
            s.add_res(p, part)
        self._departures.settle(ticket.ticket_id, path, released)
        return StoreOutcome(True, tuple(released))

    def abort(self, ticket: StoreTicket) -> StoreOutcome:
        """The copy failed or is cancelled: `dst` goes back to its tier's free set (its lease
        keeps the blocks; this is not a revoke). The eviction still happens: the nodes leave the
        device keeping only the copies they already had, and a node left with none is dropped
        with its subtree. A node needed on the device again meanwhile just stays there."""
        path = self._close(ticket)
        if ticket.dst is not None:
            self._nodes.tiers[ticket.dst_tier].free(ticket.dst)
        released: list = []
        self._departures.settle(ticket.ticket_id, path, released)
        return StoreOutcome(False, tuple(released))

    def in_flight(self) -> int:
        return len(self._tickets)

    def tickets(self) -> Iterator[StoreTicket]:
        """The stores in flight (read only)."""
        return iter(self._tickets.values())

    def path(self, ticket: StoreTicket) -> list:
        """The nodes `ticket` covers, in path order (one, or more after splits)."""
        path, n, x = [], 0, ticket.node
        while n < ticket.num_tokens:
            path.append(x)
            n += len(x.key)
            x = x.parent
        path.reverse()
        return path

    def release_all(self) -> None:
        """Give every destination of a store in flight back to its tier (before a reset)."""
        for t in self._tickets.values():
            if t.dst is not None:
                self._nodes.tiers[t.dst_tier].free(t.dst)

    # ---- begin and cancel (the eviction's) ------------------------------------------------------

    def begin(self, x: Node, dev: Any, tier: str, dst: Any, steps: list) -> StoreTicket:
        """Start copying leaving `x` (from `dev`) into `dst` of `tier`; appended to `steps`."""
        ticket = StoreTicket(next(self._ids), x, len(x.key), dev, tier, dst,
                             transfer=Transfer(DEVICE, dev, tier, dst))
        self._tickets[ticket.ticket_id] = ticket
        self._departures.wait_for(x, ticket)
        x.pins += 1  # the store's pin; the departure holds another
        steps.append(ticket)
        return ticket

    def cancel(self, ticket: StoreTicket, steps: list) -> tuple[bool, Optional[StoreTicket]]:
        """Making room drops the destination of a store begun in the running eviction: the copy
        moves down to another tier with free room (device to there, directly: the store begun
        instead is returned), else the node leaves with the copies it has, or none. Returns
        whether the node left the tree, and the store begun instead, if any."""
        s = self._nodes
        x = ticket.node
        del self._tickets[ticket.ticket_id]
        x.pins -= 1
        self._departures.wait_for(x, None)
        s.tiers[ticket.dst_tier].free(ticket.dst)
        if len(x.res) == 1:  # no other copy: one-phase eviction cascaded the fresh copy
            for target, pref in self._demotion.targets(x, s):
                if target != ticket.dst_tier and target in s.tiers:
                    moved = s.tiers[target].alloc(ticket.num_tokens, pref)
                    if moved is not None:
                        return False, self.begin(x, ticket.src, target, moved, steps)
        parent = x.parent
        self._departures.leave(x, steps)
        return parent.children.get(x.ck) is not x, None

    # ---- revocation -----------------------------------------------------------------------------

    def pending(self, tier: str) -> list:
        """Destinations in `tier` of stores in flight (allocated, not yet in any node)."""
        return [t.dst for t in self._tickets.values() if t.dst_tier == tier and t.dst is not None]

    def revoke_dst(self, hit: Callable[[Any], bool], gone_blocks: Optional[set]) -> list:
        """A donor took back blocks: each store into a donor residency `hit` selects becomes
        stale (returns their ids) and keeps only its blocks not in `gone_blocks` (None: all
        gone), reserved until it settles."""
        stale = []
        for t in self._tickets.values():
            if t.dst_tier == DONOR and t.dst is not None and hit(t.dst):
                if not t.stale:
                    t.stale = True
                    stale.append(t.ticket_id)
                d = t.dst
                keep = array("q", [] if gone_blocks is None else
                             [b for b in d.blocks if b not in gone_blocks])
                t.dst = DonorResidency(d.donor, d.lease, d.epoch, keep) if keep else None
        return stale

    def _close(self, ticket: StoreTicket) -> list:
        if self._tickets.pop(ticket.ticket_id, None) is None:
            raise ValueError(f"store ticket {ticket.ticket_id} is not in flight (settled twice?)")
        path = self.path(ticket)
        for p in path:
            p.pins -= 1
        return path
