"""Exchange a donor hit with device victims in place (mixin of `RadixTree`).

A donor-tier hit H needs device room. When the donor tier has no free room for the victims that
room displaces, demoting them pushes other prefixes out of the donor tier while H still holds
its blocks there: a two-tier cache loses |H| tokens of capacity per such hit, where one pool of
the same total size loses nothing (H is already in it). An exchange swaps them instead: H's
tokens go to the victims' device slots and the victims' tokens to H's donor blocks, position for
position, so neither tier gains or loses a token and nothing else is pushed out.

`exchange(m, swap)` picks the victims (unlocked, unpinned device leaves that have no lower copy
and no device child still leaving, never the hit's device parent, in the eviction policy's
order; the last one split so that they hold exactly |H| tokens), calls
`swap(slots, blocks)`, the caller's data path, which must exchange device slot `slots[i]` with
row `i % page_size` of donor block `blocks[i // page_size]` for every layer before anything
reads either side, and records the outcome. Nothing else runs on the tree meanwhile: the swap is
synchronous for it (CPU: copied; GPU: enqueued ahead of every later kernel). When `swap` reports
failure, both sides may be half exchanged: H's donor copy and the victims' device copy are both
dropped (with their nodes, which had no other copy) and the caller frees the returned slots; a
prefix is recomputed, never read wrong.
"""

from __future__ import annotations

import heapq
from array import array
from typing import Any, Callable, Optional

from radix_ext.residency import DEVICE, DONOR, DeviceResidency, DonorResidency
from radix_ext.results import ExchangeResult, Match
from radix_ext.slot_runs import join

Swap = Callable[[array, array], bool]


class ExchangeMixin:
    def exchangeable(self, m: Match) -> Optional[tuple]:
        """The donor part of `m` as one exchange can take it: (nodes in path order, their lease
        key (donor, lease, epoch), their blocks in order, tokens); None when `m` has no load, a
        load from another tier or lease, a node with a copy in another tier too, or a node some
        load or store holds (pinned)."""
        if self.donor is None or not m.loads:
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
        """Swap the donor part of match `m` (see `exchangeable`) with device victims; None when
        it cannot (nothing changed but, perhaps, a victim split in two). Otherwise the result
        says whether the swap happened (`ok`: the hit is on the device ending at `last_node`,
        the victims in the donor tier) or failed (both sides dropped; free
        `device_indices_to_free`)."""
        found = self.exchangeable(m)
        if found is None:
            return None
        hit, (donor, lease, epoch), blocks, num_tokens = found
        anchor = m.last_device_node
        victims = self._exchange_victims(num_tokens, anchor)
        if victims is None:
            return None
        slots = join([v.res[DEVICE].indices for v in victims])
        for x in (*hit, *victims):
            x.pins += 1  # whatever `swap` does meanwhile, these stay
        try:
            ok = bool(swap(slots, blocks))
        finally:
            for x in (*hit, *victims):
                x.pins -= 1
        self.clock += 1  # tier contents changed: no cached make-room scan is valid
        if not ok:
            return ExchangeResult(False, anchor, num_tokens, self._drop_exchanged(hit, victims))
        page, pos = self.page_size, 0
        for x in hit:
            n = len(x.key)
            self._pop_res(x, DONOR)  # its blocks pass to the victims below
            self._add_res(x, DeviceResidency(slots[pos : pos + n]))
            pos += n
        pos = 0
        for v in victims:
            n = len(v.key)
            self._pop_res(v, DEVICE)
            self._add_res(v, DonorResidency(donor, lease, epoch,
                                            blocks[pos // page : (pos + n) // page]))
            pos += n
        for x in (*victims, *(v.parent for v in victims), *hit, anchor):
            self._refresh_leaf(x)
        return ExchangeResult(True, hit[-1], num_tokens)

    def _exchange_victims(self, num_tokens: int, anchor: Any) -> Optional[list]:
        """Device leaves with no lower copy holding exactly `num_tokens` tokens, in eviction
        order (a parent becomes one once its device children are all taken); the last one is
        split so the sum is exact. Never `anchor` (the hit's device parent), so never its path.
        None when the device has too few."""

        def free_leaf(x: Any, taken: set) -> bool:
            """On the device only, unheld, not leaving, no device child but taken ones."""
            return (x is not anchor and not x.lock_ref and not x.pins and len(x.res) == 1
                    and DEVICE in x.res and x not in self._leaving
                    and all(c in taken or DEVICE not in c.res for c in x.children.values()))

        victims: list = []
        total = 0
        for x in self._eviction_order(free_leaf):
            if total >= num_tokens:
                break
            need = num_tokens - total
            if len(x.key) > need:
                self._split(x, len(x.key) - need)  # `x` keeps its tail: exactly `need` tokens
            victims.append(x)
            total += len(x.key)
        return victims if total == num_tokens else None

    def demotion_volume(self, num_tokens: int) -> int:
        """Tokens `evict_device(num_tokens)` would demote into lower tiers now: its victims are
        whole leaves in the eviction policy's order (more than `num_tokens` when the last is
        larger than what is left), and those that already have a lower copy need no room there.
        Changes nothing."""

        def leaf(x: Any, gone: set) -> bool:
            """As `evict_device` finds leaves: unheld, not leaving, device children gone or
            leaving."""
            return (not x.lock_ref and not x.pins and x not in self._leaving
                    and all(c in gone or c in self._leaving or DEVICE not in c.res
                            for c in x.children.values()))

        evicted = demoted = 0
        for x in self._eviction_order(leaf):
            if evicted >= num_tokens:
                break
            evicted += len(x.key)
            demoted += len(x.key) if len(x.res) == 1 else 0
        return demoted

    def _eviction_order(self, is_leaf: Callable[[Any, set], bool]):
        """Device leaves for which `is_leaf(x, taken)` holds, in the eviction policy's order,
        as an eviction would take them without changing the tree: each one yielded counts as
        taken, and its parent joins once `is_leaf(parent, taken)` holds. The consumer may split
        a yielded node (its head becomes the parent considered next)."""
        pol = self.eviction
        taken: set = set()
        heap = [(pol.device_priority(x, self), x.id, x) for x in self._dev_leaves
                if is_leaf(x, taken)]
        heapq.heapify(heap)
        while heap:
            _, _, x = heapq.heappop(heap)
            yield x
            taken.add(x)
            p = x.parent
            if p is not self.root and is_leaf(p, taken):
                heapq.heappush(heap, (pol.device_priority(p, self), p.id, p))

    def _drop_exchanged(self, hit: tuple, victims: list) -> array:
        """A failed swap: neither H's donor blocks nor the victims' slots hold what the tree says.
        Drop both (each had no other copy); returns the device slots to free."""
        released: list = []
        for x in (hit[0], *victims):
            if x.parent is not None and x.parent.children.get(x.ck) is x:
                for y in self._remove_subtree(x, released):
                    if y.pins:  # a load through a node below: it fails, as after a revoke
                        self._mark_stale(y)
        return join([r.residency.indices for r in released if r.tier == DEVICE])
