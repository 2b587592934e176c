"""Content fetched from outside the tree into a lower tier (mixin of `RadixTree`): L3 storage
below the host tier.

A fetch is two-phase: `reserve(tier, n)` books `n` tokens of the tier (room made as for a
demotion) for the fetcher to fill; `attach(rid, key, start, namespace)` then adds what it filled
as the continuation of the cached prefix `key[:start]`, or `unreserve(rid)` gives it back. The
tree reads nothing of a reservation until it is attached.
"""

from __future__ import annotations

from array import array
from typing import Any, Optional, Sequence

from radix_ext.results import Released


class FetchedMixin:
    def reserve(self, tier: str, num_tokens: int) -> Optional[tuple[int, Any, tuple]]:
        """Book `num_tokens` (page-aligned) of `tier` for a fetch: (reservation id, residency,
        released) or None when the tier has no room even after dropping its droppable copies
        (`released`: those dropped, already back in their tier)."""
        if tier not in self.tiers:
            raise ValueError(f"no {tier} tier to fetch into")
        if num_tokens <= 0 or num_tokens % self.page_size:
            raise ValueError(f"a fetch reserves whole pages of {self.page_size} tokens, "
                             f"got {num_tokens}")
        released: list = []
        res = self._alloc_or_make_room(tier, num_tokens, released)
        if res is None:
            return None
        rid = self._next_ticket
        self._next_ticket += 1
        self._reserved[rid] = res
        return rid, res, tuple(r for r in released if type(r) is Released)

    def unreserve(self, rid: int) -> None:
        res = self._reserved.pop(rid)
        self.tiers[res.tier].free(res)

    def attach(self, rid: int, key: Sequence[int], start: int, num_tokens: int,
               namespace: Any = None) -> int:
        """Add the first `num_tokens` of reservation `rid` (tokens `key[start:start +
        num_tokens]`) below the cached prefix `key[:start]`; returns the tokens added.

        Contract: the prefix must still be in the tree (any tier), else nothing is added. Tokens
        the tree holds already (another copy arrived meanwhile) and the unfilled rest go back to
        the tier. The reservation ends either way."""
        res = self._reserved.pop(rid)
        tier, page = res.tier, self.page_size
        num_tokens -= num_tokens % page
        end = start + num_tokens
        m = self.match(key[:end], namespace)
        covered = m.prefix_len
        if covered < start or covered >= end:
            self.tiers[tier].free(res)
            return 0
        head, rest = res.split(covered - start, page) if covered > start else (None, res)
        if head is not None:
            self.tiers[tier].free(head)
        keep, tail = rest.split(end - covered, page) if len(rest.indices) > end - covered \
            else (rest, None)
        if tail is not None:
            self.tiers[tier].free(tail)
        node = m.last_node
        k = array("q", key[covered:end])
        ck = self._child_key(k, 0, node, namespace)
        leaf = self._new_node(node, k, ck)
        leaf.last_access = self.clock
        node.children[ck] = leaf
        self._add_res(leaf, keep)
        return end - covered
