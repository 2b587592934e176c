"""`LoadBack`: two-phase load-back of lower-tier nodes onto the device."""

from __future__ import annotations

from array import array
from typing import Any, Iterator, Optional

from radix_ext.departures import Departures
from radix_ext.node import Node
from radix_ext.residency import DEVICE, DeviceResidency
from radix_ext.results import LoadOutcome, LoadTicket, Transfer
from radix_ext.slot_runs import as_run
from radix_ext.structure import Structure


class LoadBack:
    """Load-backs in flight, by ticket id (ids drawn from the tree's shared counter)."""

    def __init__(self, nodes: Structure, departures: Departures, ticket_ids: Iterator[int]):
        self._nodes = nodes
        self._departures = departures
        self._ids = ticket_ids
        self._tickets: dict[int, LoadTicket] = {}

    def begin(self, last_node: Node, device_indices: array) -> Optional[LoadTicket]:
        """Start bringing the non-device nodes on the path to `last_node` back to the device.

        Contract: `device_indices` are slots the caller allocated, one per token of those nodes
        in path order (`Match.load_len` of them). Returns a ticket whose `copies` say what to
        copy from which tier, or None (nothing changed) when there is nothing to load or another
        load is in flight through one of the nodes. Until `complete_load_back` or
        `abort_load_back`, the nodes are pinned and the device part of the path is locked; the
        tree otherwise looks exactly as before (a match still reports them as loads).
        """
        s = self._nodes
        path = []
        x = last_node
        while x is not s.root and DEVICE not in x.res:
            path.append(x)
            x = x.parent
        if not path or any(p.pins for p in path):
            return None
        path.reverse()
        total = sum(len(p.key) for p in path)
        if len(device_indices) != total:
            raise ValueError(f"load-back of {total} tokens got {len(device_indices)} device "
                             f"indices")
        idx = as_run(device_indices)
        anchor = x
        self._departures.lock(anchor)
        copies = []
        pos = 0
        for p in path:
            p.pins += 1
            seg = s.cheapest(p)
            n = len(p.key)
            copies.append(Transfer(seg.tier, seg.source, DEVICE,
                                   DeviceResidency(idx[pos : pos + n])))
            pos += n
        ticket = LoadTicket(next(self._ids), anchor, last_node, idx, tuple(copies))
        self._tickets[ticket.ticket_id] = ticket
        return ticket

    def complete(self, ticket: LoadTicket) -> LoadOutcome:
        """The copies of `ticket` finished. If no revoke or insert overtook it, its nodes are now
        on the device (their lower-tier copies stay, as write-through copies) and the caller holds
        a lock on `last_node`. A stale ticket fails like `abort_load_back`."""
        if ticket.stale:
            return self.abort(ticket)
        s = self._nodes
        path = self._close(ticket)
        pos = 0
        idx = ticket.device_indices
        for p in path:
            n = len(p.key)
            s.add_res(p, DeviceResidency(idx[pos : pos + n]))
            pos += n
        for p in reversed(path):
            s.refresh_leaf(p)
        s.refresh_leaf(ticket.anchor)
        self._departures.lock(ticket.last_node)
        self._departures.unlock(ticket.anchor)
        return LoadOutcome(True, ticket.last_node)

    def abort(self, ticket: LoadTicket) -> LoadOutcome:
        """The fetch failed or is cancelled: unpin and unlock, leaving the tree as before the
        `begin_load_back`; the caller frees the ticket's device slots."""
        self._close(ticket)
        self._departures.unlock(ticket.anchor)
        return LoadOutcome(False, ticket.anchor, ticket.device_indices)

    def in_flight(self) -> int:
        return len(self._tickets)

    def tickets(self) -> Iterator[LoadTicket]:
        """The load-backs in flight (read only)."""
        return iter(self._tickets.values())

    def path(self, ticket: LoadTicket) -> list:
        """The nodes `ticket` loads, in path order."""
        path = []
        x = ticket.last_node
        while x is not ticket.anchor:
            path.append(x)
            x = x.parent
        path.reverse()
        return path

    def mark_stale(self, node: Any) -> list:
        """Every in-flight load through `node` must fail: it is marked stale and unpins its
        nodes at once (they are ordinary nodes again); returns the ticket ids."""
        ids = []
        for t in self._tickets.values():
            if not t.stale:
                path = self.path(t)
                if node in path:
                    t.stale = True
                    self._unpin(path)
                    ids.append(t.ticket_id)
        return ids

    def _close(self, ticket: LoadTicket) -> list:
        if self._tickets.pop(ticket.ticket_id, None) is None:
            raise ValueError(f"load ticket {ticket.ticket_id} is not in flight (completed twice?)")
        path = self.path(ticket)
        if not ticket.stale:  # a stale ticket gave its pins back when it went stale
            self._unpin(path)
        return path

    def _unpin(self, path: list) -> None:
        for p in path:
            p.pins -= 1
        for p in path:
            self._nodes.refresh_leaf(p)
