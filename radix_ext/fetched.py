"""`Fetched`: content fetched from outside the tree into a lower tier (L3 storage below the
host tier).

A fetch is two-phase: `reserve(tier, n)` books `n` tokens of the tier (room made as for a
demotion) for the fetcher to fill; `attach(rid, key, start, namespace)` then adds what it filled
as the continuation of the cached prefix `key[:start]`, or `unreserve(rid)` gives it back. The
tree reads nothing of a reservation until it is attached.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable, Iterator, Optional, Sequence

from radix_ext.results import Match, Released
from radix_ext.room import Room
from radix_ext.structure import Structure


class Fetched:
    """Fetch reservations, by id (ids drawn from the tree's shared counter). `match` is the
    tree's own: an attach continues the prefix a match finds."""

    def __init__(self, nodes: Structure, room: Room, ticket_ids: Iterator[int],
                 match: Callable[[Sequence[int], Any], Match]):
        self._nodes = nodes
        self._room = room
        self._ids = ticket_ids
        self._match = match
        self._reserved: dict[int, Any] = {}

    def reservations(self) -> Iterator[Any]:
        """The residencies reserved and not yet attached (read only)."""
        return iter(self._reserved.values())

    def release_all(self) -> None:
        """Give every reservation back to its tier (before a reset)."""
        for res in self._reserved.values():
            self._nodes.tiers[res.tier].free(res)

    def reserve(self, tier: str, num_tokens: int) -> Optional[tuple[int, Any, tuple]]:
        """Book `num_tokens` (page-aligned) of `tier` for a fetch: (reservation id, residency,
        released) or None when the tier has no room even after dropping its droppable copies
        (`released`: those dropped, already back in their tier)."""
        nodes = self._nodes
        if tier not in nodes.tiers:
            raise ValueError(f"no {tier} tier to fetch into")
        if num_tokens <= 0 or num_tokens % nodes.page_size:
            raise ValueError(f"a fetch reserves whole pages of {nodes.page_size} tokens, "
                             f"got {num_tokens}")
        released: list = []
        res = self._room.alloc_or_make_room(tier, num_tokens, released)
        if res is None:
            return None
        rid = next(self._ids)
        self._reserved[rid] = res
        return rid, res, tuple(r for r in released if type(r) is Released)

    def unreserve(self, rid: int) -> None:
        res = self._reserved.pop(rid)
        self._nodes.tiers[res.tier].free(res)

    def attach(self, rid: int, key: Sequence[int], start: int, num_tokens: int,
               namespace: Any = None) -> int:
        """Add the first `num_tokens` of reservation `rid` (tokens `key[start:start +
        num_tokens]`) below the cached prefix `key[:start]`; returns the tokens added.

        Contract: the prefix must still be in the tree (any tier), else nothing is added. Tokens
        the tree holds already (another copy arrived meanwhile) and the unfilled rest go back to
        the tier. The reservation ends either way."""
        nodes = self._nodes
        res = self._reserved.pop(rid)
        tier, page = res.tier, nodes.page_size
        num_tokens -= num_tokens % page
        end = start + num_tokens
        m = self._match(key[:end], namespace)
        covered = m.prefix_len
        if covered < start or covered >= end:
            nodes.tiers[tier].free(res)
            return 0
        head, rest = res.split(covered - start, page) if covered > start else (None, res)
        if head is not None:
            nodes.tiers[tier].free(head)
        keep, tail = rest.split(end - covered, page) if len(rest.indices) > end - covered \
            else (rest, None)
        if tail is not None:
            nodes.tiers[tier].free(tail)
        node = m.last_node
        k = array("q", key[covered:end])
        ck = nodes.child_key(k, 0, node, namespace)
        leaf = nodes.new_node(node, k, ck)
        leaf.last_access = nodes.clock
        node.children[ck] = leaf
        nodes.add_res(leaf, keep)
        return end - covered
