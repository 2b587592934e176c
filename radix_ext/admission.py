"""Admission and eviction as every user of the tree runs them: the live cache, the simulator and
`bench_tree` call these, so the sequence exists once.

Admission: match; lock the device part (so making room cannot evict the prefix being admitted);
allocate device slots, evicting what is needed; match again only if that eviction touched the
lower-tier part of the match; begin the load-back of that part. Eviction: plan it in the tree,
run its copies, settle each store, free the device slots that came back.

The caller supplies a `DevicePool` (its slot allocator and its copy engine). Nothing here copies
or frees memory itself, and loads and stores are tickets: `admit` returns the load in flight,
which the caller may complete at once (the live cache today) or later, when the request is
actually scheduled (the simulator; SGLang's `init_load_back` next).
"""

from __future__ import annotations

from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from radix_ext.results import LoadTicket, Match, StoreTicket, Transfer
from radix_ext.slot_runs import join


class DevicePool:
    """What admission and eviction need from their caller. Subclass it; the defaults say what a
    caller without lower-tier copies or memory to reclaim does."""

    def available(self) -> int:
        """Device slots free now."""
        raise NotImplementedError

    def alloc(self, num_tokens: int) -> Optional[Sequence[int]]:
        """`num_tokens` free device slots, or None (taking nothing) when fewer are free."""
        raise NotImplementedError

    def free(self, indices: Sequence[int]) -> None:
        """Give device slots back (slots the tree released, or ones `alloc` returned)."""
        raise NotImplementedError

    def run_copies(self, copies: Sequence[Transfer]) -> Sequence[bool]:
        """Run an eviction plan's copies, in order; per copy, whether it happened. A copy may
        finish later (the simulator's links) as long as nothing reads its destination first."""
        if copies:
            raise RuntimeError(f"the tree planned {len(copies)} lower-tier copies but this caller "
                               f"has no data path; configure the tree without lower tiers")
        return ()

    def make_room(self, tree: Any, num_tokens: int) -> int:
        """Evict at least `num_tokens` device tokens for an admission (fewer if not enough are
        evictable); returns the tokens evicted. Default: `evict` (copies run and settle at
        once). A caller whose stores settle later overrides it; `admit` checks the free slots
        afterwards, so room that is still on its way out fails the admission."""
        return evict(tree, self, num_tokens)

    def reclaim(self, num_tokens: int) -> None:
        """Called once the device part of an admission is locked, with the slots it needs,
        before free space is checked: where a donor takes back pages it lent. Default: nothing."""


@dataclass(frozen=True, slots=True)
class Admission:
    """What `admit` did. Not `ok`: not enough device memory; nothing is held or allocated.
    `ok`: the caller holds a lock on `anchor` (the end of the device part of `match`; release it
    with `tree.unlock`), `load` is the load-back in flight for `match.loads` (None when there is
    nothing to load or it could not start; its slots are the caller's until the ticket settles),
    and `slots` are the slots allocated for the tokens beyond the prefix. `rematched`: the
    eviction touched the load part, so `match` is a second match; `evicted`: tokens evicted."""

    ok: bool
    match: Match
    anchor: Any
    load: Optional[LoadTicket] = None
    slots: Sequence[int] = field(default_factory=lambda: array("q"))
    rematched: bool = False
    evicted: int = 0

    @property
    def prefix_len(self) -> int:
        """Tokens the request will not compute: the device part, plus the load part if loading."""
        return self.match.prefix_len if self.load is not None else self.match.device_len


def settle(tree: Any, stores: Sequence[StoreTicket], done: Sequence[bool]) -> array:
    """Complete each store whose copy happened (`done`), abort the others; the device slots the
    caller must free now."""
    out = []
    for ticket, ok in zip(stores, done):
        outcome = tree.complete_store(ticket) if ok else tree.abort_store(ticket)
        out.append(outcome.device_indices_to_free())
    return join(out)


def evict(tree: Any, pool: DevicePool, num_tokens: int) -> int:
    """Evict at least `num_tokens` device tokens (fewer if not enough are evictable): run the
    plan's copies through `pool`, settle every store, free what came back. Returns the tokens
    evicted. Stores settle at once here; a caller that lets them run on should drive
    `evict_device` / `complete_store` itself."""
    plan = tree.evict_device(num_tokens)
    copies, stores, store_at = [], [], []
    for step in plan.steps:
        if type(step) is Transfer:
            copies.append(step)
        elif type(step) is StoreTicket:
            store_at.append(len(copies))
            copies.append(step.transfer)
            stores.append(step)
    done = pool.run_copies(copies) if copies else ()
    to_free = join([plan.device_indices_to_free(),
                    settle(tree, stores, [done[i] for i in store_at])])
    if len(to_free):
        pool.free(to_free)
    return plan.num_evicted


def admit(tree: Any, pool: DevicePool, key: Sequence[int], namespace: Any = None, *,
          total: Optional[int] = None, load: bool = True,
          match: Optional[Match] = None) -> Admission:
    """Admit `key`: match, lock the device part, allocate (evicting), re-match if needed, begin
    the load-back.

    `total`: device tokens the request needs in all (prefix and new ones); slots are allocated
    for `total - prefix`. None: only the load part is allocated (the caller allocates the rest
    later). `load`: whether to load the lower-tier part back (False: it is recomputed).
    `match`: a match of `key` the caller just made, if any (saves matching again).
    """
    m = tree.match(key, namespace) if match is None else match
    loading = load and bool(m.loads)
    need = (total - m.device_len) if total is not None else (m.load_len if loading else 0)
    anchor = m.last_device_node
    tree.lock(anchor)
    pool.reclaim(need)
    evicted, rematched = 0, False
    if pool.available() < need:
        if pool.available() + tree.evictable_size() < need:
            tree.unlock(anchor)
            return Admission(False, m, anchor)
        evicted = pool.make_room(tree, need - pool.available())
        if pool.available() < need:
            tree.unlock(anchor)
            return Admission(False, m, anchor, evicted=evicted)
        if loading and not _loads_intact(m):
            m = tree.match(key, namespace)  # the locked device part cannot have changed
            assert m.last_device_node is anchor, "a locked device prefix changed under eviction"
            loading, rematched = bool(m.loads), True
    ticket = None
    if loading:
        idx = pool.alloc(m.load_len)
        if idx is not None:
            ticket = tree.begin_load_back(m.last_node, idx)
            if ticket is None:  # another load through these nodes is in flight: recompute
                pool.free(idx)
    prefix = m.prefix_len if ticket is not None else m.device_len
    slots: Sequence[int] = array("q")
    if total is not None and total > prefix:
        slots = pool.alloc(total - prefix)
        assert slots is not None, "room was checked for every slot this admission allocates"
    return Admission(True, m, anchor, ticket, slots, rematched, evicted)


def should_exchange(tree: Any, m: Match, room: int) -> bool:
    """Whether to swap the donor part of `m` with device victims (`RadixTree.exchange`) instead
    of loading it into room made by demotion: making that room (`room` device tokens) would
    demote more into the donor tier than it has free (`RadixTree.demotion_volume`: whole
    leaves, those without a lower copy), so demoting would push other prefixes out of it while
    the hit still holds its own blocks there. Otherwise the hit streams in under the forward
    and costs the donor tier nothing."""
    if room <= 0 or tree.donor is None or tree.exchangeable(m) is None:
        return False
    return tree.donor.available_tokens() < tree.demotion_volume(room)


@contextmanager
def holding(m: Match):
    """Pin the lower-tier part of `m` while room is made for it: making device room demotes
    victims into the lower tiers, and their room there would otherwise be made by dropping the
    least recently used lower copies, which in a multi-turn workload are often exactly the prefix
    about to be loaded (the oldest conversation is the next to come back). Pinned nodes are
    neither evicted, demoted nor dropped; the pins are gone when the block ends, before any
    load-back pins the path for real."""
    nodes = tuple(dict.fromkeys(seg.node for seg in m.loads))
    for node in nodes:
        node.pins += 1
    try:
        yield
    finally:
        for node in nodes:
            node.pins -= 1


def _loads_intact(m: Match) -> bool:
    """Whether every load of `m` still has its source (an eviction may have dropped or moved
    lower-tier copies to make room; it never changes a locked device part)."""
    return all(seg.node.res.get(seg.tier) is seg.source for seg in m.loads)
