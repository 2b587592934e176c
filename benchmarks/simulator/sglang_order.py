"""Device slots allocated in SGLang 0.5.23's order, with the live borrower's `init_load_back`
(`ModelServer(alloc_per_step=True)`, the CPU-node validation).

SGLang allocates a request's extend tokens when it admits it and one slot per running request in
each decode step (`alloc_token_slots`), each allocation evicting only its shortfall
(`evict_to_free_tokens`). A borrower's `init_load_back` (integration/donor_hits.py) first makes
room for the donor hit, the extend tokens and one page, then loads the hit: all of it, or nothing
when the room-making changed the match; when that room would push prefixes out of a full donor
tier, it first swaps the hit with device victims (`RadixTree.exchange`). The simulator's default
allocates prompt and output at admission in one eviction; which victims go, and so what a donor
tier keeps, differs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

from radix_ext import (
    DEVICE,
    DONOR,
    DevicePool,
    DeviceResidency,
    DonorResidency,
    Transfer,
    holding,
    should_exchange,
)
from radix_ext import admit as tree_admit
from radix_ext.admission import Admission


def admit(cache: Any, pool: DevicePool, key: Sequence[int], prompt_pages: int,
          load: bool) -> Optional[Admission]:
    """Admit a request whose prompt is `prompt_pages` pages (`key`: its matchable part) into
    `cache` (a TreeCache); its `slots` are the prompt's pages past the prefix. None when out of
    memory (nothing held)."""
    tree = cache.tree
    m = tree.match(key)
    if not (load and m.loads):
        a = tree_admit(tree, pool, key, total=prompt_pages, load=False, match=m)
        return a if a.ok else None
    need = prompt_pages - m.device_len + 1  # the hit, the extend tokens and one page
    pinned = m.last_device_node
    cache.lock(pinned)  # SGLang pins the device prefix while it admits
    if pool.available() < need and should_exchange(tree, m, need - pool.available()):
        _exchange(tree, pool, m)  # as the live init_load_back: the hit swaps with victims
        m = tree.match(key)
        need = prompt_pages - m.device_len + 1
    if pool.available() < need:
        with holding(m):  # as the live init_load_back: its own donor part stays put
            pool.make_room(tree, need - pool.available())
    cache.unlock(pinned)
    a = tree_admit(tree, pool, key, total=None, load=True)
    if not a.ok:
        return None
    if a.load is not None and (a.match.last_device_node is not m.last_device_node
                               or len(a.load.device_indices) != m.load_len):
        cache.free(tree.abort_load_back(a.load).device_indices_to_free)  # changed: recompute
        a = replace(a, load=None)
    extend = prompt_pages - a.prefix_len
    if pool.available() < extend:
        pool.make_room(tree, extend - pool.available())
    slots = pool.alloc(extend)
    if slots is None:
        if a.load is not None:
            cache.free(tree.abort_load_back(a.load).device_indices_to_free)
        cache.unlock(a.anchor)
        return None
    return replace(a, slots=slots)


def _exchange(tree: Any, pool: DevicePool, m: Any) -> None:
    """The live borrower's exchange (`RadixTree.exchange`): both directions start on the links
    and the step's compute waits for them, as it does for a demotion; they never fail here."""
    _, (donor, lease, epoch), _, _ = tree.exchangeable(m)

    def swap(slots, blocks) -> bool:
        there = DonorResidency(donor, lease, epoch, blocks)
        here = DeviceResidency(slots)
        pool.run_copies([Transfer(DONOR, there, DEVICE, here),
                         Transfer(DEVICE, here, DONOR, there)])
        return True

    tree.exchange(m, swap)


def decode_slots(cache: Any, pool: DevicePool, running: list, name: str) -> None:
    """One slot per running request for the token this decode step feeds in (appended to its
    own slots), evicting only the shortfall."""
    n = len(running)
    if pool.available() < n:
        pool.make_room(cache.tree, n - pool.available())
    slots = pool.alloc(n)
    if slots is None:
        raise RuntimeError(f"{name}: no room for a decode step of {n} requests (the simulator "
                           f"does not retract); give the server a larger pool")
    for r, slot in zip(running, slots):
        r.own.append(slot)
