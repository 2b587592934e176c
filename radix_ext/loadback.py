"""Two-phase load-back of lower-tier nodes onto the device (mixin of `RadixTree`)."""

from __future__ import annotations

from array import array
from typing import Any, Optional

from radix_ext.residency import DEVICE, DeviceResidency
from radix_ext.results import LoadOutcome, LoadTicket, Transfer
from radix_ext.slot_runs import as_run


class LoadBackMixin:
    def begin_load_back(self, last_node: Any, device_indices: array) -> Optional[LoadTicket]:
        """Start bringing the non-device nodes on the path to `last_node` back to the device.

        Contract: `device_indices` are slots the caller allocated, one per token of those nodes
        in path order (`Match.load_len` of them). Returns a ticket whose `copies` say what to
        copy from which tier, or None (nothing changed) when there is nothing to load or another
        load is in flight through one of the nodes. Until `complete_load_back` or
        `abort_load_back`, the nodes are pinned and the device part of the path is locked; the
        tree otherwise looks exactly as before (a match still reports them as loads).
        """
        path = []
        x = last_node
        while x is not self.root and DEVICE not in x.res:
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
        self.lock(anchor)
        copies = []
        pos = 0
        for p in path:
            p.pins += 1
            seg = self._cheapest(p)
            n = len(p.key)
            copies.append(Transfer(seg.tier, seg.source, DEVICE,
                                   DeviceResidency(idx[pos : pos + n])))
            pos += n
        ticket = LoadTicket(self._next_ticket, anchor, last_node, idx, tuple(copies))
        self._tickets[ticket.ticket_id] = ticket
        self._next_ticket += 1
        return ticket

    def complete_load_back(self, ticket: LoadTicket) -> LoadOutcome:
        """The copies of `ticket` finished. If no revoke or insert overtook it, its nodes are now
        on the device (their lower-tier copies stay, as write-through copies) and the caller holds
        a lock on `last_node`. A stale ticket fails like `abort_load_back`."""
        if ticket.stale:
            return self.abort_load_back(ticket)
        path = self._close_ticket(ticket)
        pos = 0
        idx = ticket.device_indices
        for p in path:
            n = len(p.key)
            self._add_res(p, DeviceResidency(idx[pos : pos + n]))
            pos += n
        for p in reversed(path):
            self._refresh_leaf(p)
        self._refresh_leaf(ticket.anchor)
        self.lock(ticket.last_node)
        self.unlock(ticket.anchor)
        return LoadOutcome(True, ticket.last_node)

    def abort_load_back(self, ticket: LoadTicket) -> LoadOutcome:
        """The fetch failed or is cancelled: unpin and unlock, leaving the tree as before the
        `begin_load_back`; the caller frees the ticket's device slots."""
        self._close_ticket(ticket)
        self.unlock(ticket.anchor)
        return LoadOutcome(False, ticket.anchor, ticket.device_indices)

    def in_flight(self) -> int:
        return len(self._tickets)

    def _ticket_path(self, ticket: LoadTicket) -> list:
        path = []
        x = ticket.last_node
        while x is not ticket.anchor:
            path.append(x)
            x = x.parent
        path.reverse()
        return path

    def _close_ticket(self, ticket: LoadTicket) -> list:
        if self._tickets.pop(ticket.ticket_id, None) is None:
            raise ValueError(f"load ticket {ticket.ticket_id} is not in flight (completed twice?)")
        path = self._ticket_path(ticket)
        if not ticket.stale:  # a stale ticket gave its pins back when it went stale
            self._unpin(path)
        return path

    def _unpin(self, path: list) -> None:
        for p in path:
            p.pins -= 1
        for p in path:
            self._refresh_leaf(p)

    def _mark_stale(self, node: Any) -> list:
        """Every in-flight load through `node` must fail: it is marked stale and unpins its
        nodes at once (they are ordinary nodes again); returns the ticket ids."""
        ids = []
        for t in self._tickets.values():
            if not t.stale:
                path = self._ticket_path(t)
                if node in path:
                    t.stale = True
                    self._unpin(path)
                    ids.append(t.ticket_id)
        return ids
