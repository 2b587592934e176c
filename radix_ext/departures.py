"""`Departures`: what holds a node on the device (locks, stores in flight) and when it leaves.

`evict_device` marks each victim *leaving* (`depart`): a leaving node keeps its device slots
(pinned: not evicted again, not freed, still a device hit) and its tokens count as neither
evictable nor protected. A leaving node's parent may be evicted in the same pass (its device
children are all leaving), so a plan evicts exactly what a one-phase eviction would. A leaving
node actually leaves (its device slots are returned to the caller) when its own store, if any,
has settled and none of its children is still on the device; that keeps device residency
prefix-closed whatever order the caller settles tickets in.

A leaving node stays on the device after all when it is needed there again: a lock (a request
uses it) or an insert (a device child appears under it) cancel its departure (`stay`, `keep`); a
store in flight for it still completes, as a write-through copy, and holds the node like a lock
until then (it cannot be evicted before its store settles, so it must not count as evictable).
"""

from __future__ import annotations

from typing import Any

from radix_ext.node import Node
from radix_ext.residency import DEVICE
from radix_ext.results import Released
from radix_ext.structure import Structure

UNDECIDED = "undecided"  # departure mark of the victim whose fate evict_device is deciding


class Departures:
    """Locks and departures over `Structure`'s books; the only writer of `Structure.leaving`.
    Its own state: the nodes each store in flight holds on the device, by store id."""

    def __init__(self, nodes: Structure):
        self._nodes = nodes
        self._store_holds: dict[int, list[Node]] = {}

    # ---- locks ----------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """See `RadixTree.lock`."""
        if node is self._nodes.root:
            return
        if DEVICE not in node.res:
            raise ValueError(f"lock needs a device-resident node, got {node}; load it back first")
        self.hold(node)

    def unlock(self, node: Node) -> None:
        """See `RadixTree.unlock`."""
        if node is self._nodes.root:
            return
        if node.direct_locks <= 0:
            raise ValueError(f"unlock without a matching lock on {node}")
        self.release(node)

    def hold(self, node: Node) -> None:
        """One lock on `node`, unchecked; a leaving node on the path stays on the device."""
        s = self._nodes
        node.direct_locks += 1
        root, leaving = s.root, s.leaving
        while node is not root:
            if node.lock_ref == 0 and node in leaving:
                self.stay(node)  # may hold `node` itself (a store in flight): lock_ref > 0
            if node.lock_ref == 0:
                n = len(node.key)
                s.evictable -= n
                s.protected += n
                s.leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def release(self, node: Node) -> None:
        """Release one lock on `node`, unchecked."""
        s = self._nodes
        node.direct_locks -= 1
        root = s.root
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.key)
                s.evictable += n
                s.protected -= n
                s.refresh_leaf(node)
            node = node.parent

    # ---- departures -----------------------------------------------------------------------------

    def depart(self, x: Node) -> None:
        """Mark the device leaf `x` leaving (it was unlocked and evictable); until its fate is
        decided it is UNDECIDED, so nothing settles it meanwhile."""
        s = self._nodes
        s.leaving[x] = UNDECIDED
        x.pins += 1
        n = len(x.key)
        s.evictable -= n
        s.leaving_tokens += n
        s.leaves.discard(x)

    def wait_for(self, x: Node, ticket: Any) -> None:
        """Leaving `x` leaves once store `ticket` settles (None: once its children have)."""
        self._nodes.leaving[x] = ticket

    def decide(self, x: Node, released: list) -> None:
        """The eviction found no store for `x`: it leaves now, or once its children have."""
        if self._nodes.leaving[x] is UNDECIDED:
            self._nodes.leaving[x] = None
            self.leave(x, released)

    def settle(self, ticket_id: int, path: list, released: list) -> None:
        """Store `ticket_id` over `path` settled: the nodes it held on the device are unheld, and
        its nodes leave if nothing else holds them back."""
        holds = self._store_holds.pop(ticket_id, None)
        if holds:
            for x in holds:
                self.release(x)
        s = self._nodes
        for p in path:
            if s.leaving.get(p) is not None:
                s.leaving[p] = None  # its own store is done
            s.refresh_leaf(p)
        self.leave(path[-1], released)

    def leave(self, x: Node, released: list) -> None:
        """Let `x`, then its leaving ancestors, leave the device while each is ready: its own
        store settled and no child still on the device."""
        s = self._nodes
        while s.leaving.get(x, 0) is None and not s.has_device_child(x):
            parent = x.parent
            dev = s.pop_res(x, DEVICE)  # while still leaving: the size books follow
            del s.leaving[x]
            x.pins -= 1
            released.append(Released(DEVICE, dev))
            if not x.res:
                s.remove_subtree(x, released)
            s.refresh_leaf(parent)
            x = parent

    def stay(self, x: Node) -> None:
        """Cancel the departure of leaving (so unlocked) `x`; a store in flight for it (a
        leaving node waits only on a store in flight) holds it until it settles."""
        s = self._nodes
        ticket = s.leaving.pop(x)
        x.pins -= 1
        n = len(x.key)
        s.leaving_tokens -= n
        s.evictable += n
        if ticket is not None:
            self.hold(x)
            self._store_holds.setdefault(ticket.ticket_id, []).append(x)

    def keep(self, x: Node) -> None:
        """A device child appears under `x`: `x` and its leaving ancestors stay on the device."""
        s = self._nodes
        if x not in s.leaving:
            return
        while x in s.leaving:
            self.stay(x)
            s.refresh_leaf(x)
            x = x.parent
        s.refresh_leaf(x)
