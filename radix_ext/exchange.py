"""`Exchange`: a donor hit swapped with device victims in place.

A donor-tier hit H needs device room. When the donor tier has no free room for the victims that
room displaces, demoting them pushes other prefixes out of the donor tier while H still holds
its blocks there: a two-tier cache loses |H| tokens of capacity per such hit, where one pool of
the same total size loses nothing (H is already in it). An exchange swaps them instead: H's
tokens go to the victims' device slots and the victims' tokens to H's donor blocks, position for
position, so neither tier gains or loses a token and nothing else is pushed out.

Two-phase, like a load-back: `begin_exchange(m)` picks the victims (unlocked, unpinned device
leaves that have no lower copy and no device child still leaving, never the hit's device parent, in
the eviction policy's order; the last one split so that they hold exactly |H| tokens) and records
the swap at once: H is on the device at the victims' slots, the victims are in the donor tier on
H's blocks, position for position. The caller's data path must then exchange device slot `slots[i]`
with row `i % page_size` of donor block `blocks[i // page_size]` for every layer, and call
`complete_exchange` (every layer swapped) or `abort_exchange` (any layer not). Until then both
sides are pinned (never evicted, demoted or exchanged again, dropped only by a revoke) and every
match ends before them: the one caller that began the exchange (a request that reads H in the
forward that runs the copy) is the only reader of either side. When the swap failed, both sides may
be half exchanged: H and the victims are dropped (with their subtrees, which had no other copy) and
a prefix is recomputed, never read wrong. The caller settles an exchange before anything inserts
through either side (in the server, the settle follows the forward and precedes the processing of
any batch's output, where inserts happen). `exchange(m, swap)` runs both phases around a
synchronous `swap(slots, blocks)`.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable, Iterator, Optional

from radix_ext.eviction import Eviction
from radix_ext.loadback import LoadBack
from radix_ext.node import Node
from radix_ext.residency import DEVICE, DONOR, DeviceResidency, DonorResidency
from radix_ext.results import ExchangeResult, ExchangeTicket, Match
from radix_ext.slot_runs import join
from radix_ext.structure import Structure

Swap = Callable[[array, array], bool]


class Exchange:
    """Exchanges in flight, by ticket id (ids drawn from the tree's shared counter), and
    `sides`: every node that is a side of one, mapped to its ticket (a match ends before them)."""

    def __init__(self, nodes: Structure, loads: LoadBack, eviction: Eviction,
                 ticket_ids: Iterator[int]):
        self._nodes = nodes
        self._loads = loads
        self._eviction = eviction
        self._ids = ticket_ids
        self._tickets: dict[int, ExchangeTicket] = {}
        self.sides: dict[Node, ExchangeTicket] = {}

    def exchangeable(self, m: Match) -> Optional[tuple]:
        """The donor part of `m` as one exchange can take it: (nodes in path order, their lease
        key (donor, lease, epoch), their blocks in order, tokens); None when `m` has no load, a
        load from another tier or lease, a node with a copy in another tier too, or a node some
        load or store holds (pinned)."""
        if self._nodes.donor is None or not m.loads:
            return None
        nodes, blocks, lease = [], array("q"), None
        for seg in m.loads:
            res, node = seg.source, seg.node
            if (seg.tier != DONOR or node.pins or node.res.get(DONOR) is not res
                    or len(node.res) > 1):
                return None
            key = (res.donor, res.lease, res.epoch)
            if lease is not None and key != lease:
                return None
            lease = key
            nodes.append(node)
            blocks.extend(res.blocks)
        return tuple(nodes), lease, blocks, m.load_len

    def exchange(self, m: Match, swap: Swap) -> Optional[ExchangeResult]:
        """Swap the donor part of match `m` (see `exchangeable`) with device victims, the copy
        being `swap(slots, blocks)` (True: every layer swapped); None when it cannot (nothing
        changed but, perhaps, a victim split in two). Otherwise the result says whether the swap
        happened (`ok`: the hit is on the device ending at `last_node`, the victims in the donor
        tier) or failed (both sides dropped; free `device_indices_to_free`)."""
        t = self.begin(m)
        if t is None:
            return None
        try:
            ok = bool(swap(t.slots, t.blocks))
        except BaseException:
            self.abort(t)
            raise
        if not ok:
            return ExchangeResult(False, t.anchor, t.num_tokens, self.abort(t))
        self.complete(t)
        return ExchangeResult(True, t.last_node, t.num_tokens)

    def begin(self, m: Match) -> Optional[ExchangeTicket]:
        """Record the swap of the donor part of match `m` (see `exchangeable`) with device
        victims and return its ticket (see `ExchangeTicket`: copy, then `complete_exchange` or
        `abort_exchange`); None when it cannot (nothing changed but, perhaps, a victim split in
        two). The hit may be locked at once (it is on the device); nothing else reaches it or
        the victims until the ticket settles. See `exchange.py`."""
        found = self.exchangeable(m)
        if found is None:
            return None
        s = self._nodes
        hit, (donor, lease, epoch), blocks, num_tokens = found
        anchor = m.last_device_node
        victims = self._victims(num_tokens, anchor)
        if victims is None:
            return None
        slots = join([v.res[DEVICE].indices for v in victims])
        page, pos = s.page_size, 0
        for x in hit:
            n = len(x.key)
            s.pop_res(x, DONOR)  # its blocks pass to the victims below
            s.add_res(x, DeviceResidency(slots[pos : pos + n]))
            pos += n
        pos = 0
        for v in victims:
            n = len(v.key)
            s.pop_res(v, DEVICE)
            s.add_res(v, DonorResidency(donor, lease, epoch,
                                        blocks[pos // page : (pos + n) // page]))
            pos += n
        t = ExchangeTicket(next(self._ids), anchor, hit[-1], hit, tuple(victims),
                           (donor, lease, epoch), slots, blocks, num_tokens)
        self._tickets[t.ticket_id] = t
        for x in (*hit, *victims):
            x.pins += 1
            self.sides[x] = t
        s.clock += 1  # tier contents changed: no cached make-room scan is valid
        for x in (*victims, *(v.parent for v in victims), *hit, anchor):
            s.refresh_leaf(x)
        return t

    def complete(self, t: ExchangeTicket) -> Any:
        """Every layer of `t` was swapped: both sides are ordinary nodes again (a victim a
        revoke took meanwhile stays gone). Returns the hit's last node."""
        for x in self._close(t):
            self._nodes.refresh_leaf(x)
        self._nodes.refresh_leaf(t.anchor)
        return t.last_node

    def abort(self, t: ExchangeTicket, free_hit_slots: bool = True) -> array:
        """The swap of `t` failed or never ran: the hit and the victims are dropped with their
        subtrees (either side may be half swapped) and the device slots to free are returned:
        the hit's (the victims' former slots) unless `free_hit_slots` is False (a request's row
        holds them and frees them itself), and any device node below. Nothing may hold a lock on
        the hit: move such a lock to `t.anchor` first."""
        s = self._nodes
        if any(x.lock_ref and s.attached(x) for x in t.hit):
            raise ValueError(f"exchange {t.ticket_id}: the hit is still locked; move the lock to "
                             f"its anchor before dropping it")
        nodes = self._close(t)
        kept = set() if free_hit_slots else {id(x.res.get(DEVICE)) for x in t.hit if x in nodes}
        s.clock += 1
        released: list = []
        for x in (t.hit[0], *t.victims):
            if x in nodes and s.attached(x):
                for y in s.remove_subtree(x, released):
                    if y.pins:  # a load through a node below: it fails, as after a revoke
                        self._loads.mark_stale(y)
        return join([r.residency.indices for r in released
                     if r.tier == DEVICE and id(r.residency) not in kept])

    def in_flight(self) -> int:
        return len(self._tickets)

    def tickets(self) -> Iterator[ExchangeTicket]:
        """The exchanges in flight (read only)."""
        return iter(self._tickets.values())

    def _close(self, t: ExchangeTicket) -> set:
        """Forget ticket `t` and unpin its nodes; returns those still in the tree."""
        if self._tickets.pop(t.ticket_id, None) is None:
            raise ValueError(f"exchange {t.ticket_id} is not in flight (settled twice?)")
        here = set()
        for x in (*t.hit, *t.victims):
            x.pins -= 1
            del self.sides[x]
            if self._nodes.attached(x):
                here.add(x)
        return here

    def _victims(self, num_tokens: int, anchor: Any) -> Optional[list]:
        """Device leaves with no lower copy holding exactly `num_tokens` tokens, in eviction
        order (a parent becomes one once its device children are all taken); the last one is
        split so the sum is exact. Never `anchor` (the hit's device parent), so never its path.
        None when the device has too few."""
        s = self._nodes
        leaving = s.leaving

        def free_leaf(x: Any, taken: set) -> bool:
            """On the device only, unheld, not leaving, no device child but taken ones."""
            return (x is not anchor and not x.lock_ref and not x.pins and len(x.res) == 1
                    and DEVICE in x.res and x not in leaving
                    and all(c in taken or DEVICE not in c.res for c in x.children.values()))

        victims: list = []
        total = 0
        for x in self._eviction.order(free_leaf):
            if total >= num_tokens:
                break
            need = num_tokens - total
            if len(x.key) > need:
                s.split(x, len(x.key) - need)  # `x` keeps its tail: exactly `need` tokens
            victims.append(x)
            total += len(x.key)
        return victims if total == num_tokens else None
