"""Demotions that do not block: device KV goes to donor pages by stores that run beside the
scheduler.

An eviction plans in the tree (`evict_device`): a victim that needs no copy leaves at once, and
a demotion is a `StoreTicket` whose copy begins here and runs on the copy lane while the
scheduler goes on. The victim keeps its device slots, pinned and still a device hit, until its
store settles: `settle()` (every scheduler step, and before each eviction) completes the
finished stores, aborts the failed ones (their donor pages go back to the lease, never holding a
residency over bytes that were not written) and frees the device slots the tree returns.

SGLang's allocator expects the room an `evict` asked for when it returns, so `make_room` waits
for stores in flight when what settled and what left at once is not enough. `demote_ahead` keeps
that rare: each step, while the free slots plus those already on their way out are below a
headroom, it starts demoting the least recently used prefixes early, so the room an allocation
asks for has usually been freed by the time it does. Waits are counted in
`stats["evict_wait_s"]` and `stats["evict_waits"]`.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass
from typing import Any

from radix_ext import admission
from radix_ext.results import Released, StoreTicket, Transfer

from .copies import InFlightCopy, runs_by_lease, start_copy


@dataclass(eq=False)
class StoreGroup:
    """Stores on one lease copied by one engine transfer."""

    tickets: list
    copy: InFlightCopy


class AsyncDemotions:
    """The stores in flight of one cache; runs on the scheduler thread."""

    def __init__(self, cache: Any, runtime: Any, stats: dict, copy_timeout_s: float):
        self.cache = cache  # .tree (replaced on reset) and .slots (the device pool)
        self.runtime = runtime
        self.stats = stats
        self.copy_timeout_s = copy_timeout_s
        self._groups: list[StoreGroup] = []

    def in_flight(self) -> int:
        return len(self._groups)

    # ---- eviction --------------------------------------------------------------------------
    def make_room(self, num_tokens: int, wait: bool = True) -> int:
        """Free at least `num_tokens` device slots if the tree can; returns the slots freed.
        With `wait`, waits for stores in flight when nothing else gives the room now (SGLang's
        allocator needs it); without, the room of the stores it started comes when they settle
        (a load-back admission retries then)."""
        freed = self.settle()
        if freed < num_tokens:
            freed += self.begin(self.cache.tree.evict_device(num_tokens - freed))
        while wait and freed < num_tokens and self._groups:
            start = time.perf_counter()
            self._groups[0].copy.wait(self.copy_timeout_s)
            self.stats["evict_wait_s"] += time.perf_counter() - start
            self.stats["evict_waits"] += 1
            freed += self.settle()
        return freed

    def demote_ahead(self, headroom: int) -> None:
        """Start demoting LRU prefixes while free + leaving device slots are below `headroom`,
        only into donor capacity (with no lease it would drop them for nothing)."""
        tree = self.cache.tree
        if tree.donor is None or tree.donor.capacity_tokens() == 0:
            return
        short = headroom - self.cache.slots.available() - tree.leaving_size()
        if short > 0 and tree.evictable_size() > 0:
            self.begin(tree.evict_device(short))

    def begin(self, plan: Any) -> int:
        """Start the plan's stores; free what it released at once; returns those slots."""
        to_free = array("q")
        stores = []
        for step in plan.steps:
            if type(step) is StoreTicket:
                stores.append(step)
            elif type(step) is Transfer:
                raise RuntimeError(f"no data path from {step.src_tier} to {step.dst_tier}: "
                                   f"SwiftCache's server runs the tree without a host tier")
            elif type(step) is Released and step.tier == "device":
                to_free.extend(step.residency.indices)
        for key, idx in runs_by_lease([t.dst for t in stores]):
            tickets = [stores[i] for i in idx]
            slots = [s for t in tickets for s in t.src.indices]
            blocks = [b for t in tickets for b in t.dst.blocks]
            copy = start_copy(self.runtime, key, slots, blocks)
            if copy is None:  # the donor is not writable now: the eviction drops them instead
                self.stats["refused_stores"] += 1
                to_free.extend(admission.settle(self.cache.tree, tickets, [False] * len(tickets)))
            else:
                self._groups.append(StoreGroup(tickets, copy))
                self.stats["stores_started"] += len(tickets)
        if len(to_free):
            self.cache.slots.free(to_free)
        return len(to_free)

    # ---- settling --------------------------------------------------------------------------
    def settle(self) -> int:
        """Settle every store whose copy is finished (never blocks); returns the device slots
        freed."""
        to_free = array("q")
        still = []
        for group in self._groups:
            if not group.copy.finished():
                still.append(group)
                continue
            ok = group.copy.ok()
            group.copy.release()
            to_free.extend(admission.settle(self.cache.tree, group.tickets,
                                            [ok] * len(group.tickets)))
            if ok:
                self.stats["stored_tokens"] += group.copy.num_tokens
            else:
                self.stats["refused_stores"] += 1
        self._groups = still
        if len(to_free):
            self.cache.slots.free(to_free)
        return len(to_free)

    def reset(self) -> None:
        """The tree was replaced (its tickets with it): stop the copies and forget them; the
        allocator is cleared with the tree, so no slot is freed here."""
        for group in self._groups:
            group.copy.abort("the cache was reset")
            group.copy.release()
        self._groups = []
