"""What a reclaim cost: tokens that were in the donor tier when a donor took its pages back, and
that a later request had to prefill again because they were no longer cached anywhere.

A reclaim's `RevokeResult.lost` names each subtree that lost its last copy (with a host tier, only
what the rescue found no host room for). `ReclaimLoss` keeps those prefixes and, on each insert
into the tree (after a request's prefill), counts the tokens of a lost prefix that are new to the
tree: they were prefilled, where a prefix loaded from host or fetched from L3 was in the tree
before the prefill (a count at the request's match would also take what L3 supplies after it).
Once counted, those tokens are cached again, so they are not counted twice.
Bounded: at most MAX_PREFIXES prefixes are watched (the oldest go first), and a prefix is dropped
once every token of it was asked for again. Runs on the scheduler thread, on every insert while
something is watched: only the prefixes that begin with the request's first token are compared.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

MAX_PREFIXES = 512


class ReclaimLoss:
    def __init__(self, limit: int = MAX_PREFIXES):
        self.limit = limit
        # (namespace, first token) -> [tokens, tokens still cached] per watched prefix
        self._lost: dict[tuple, list[list]] = {}
        self._order: deque = deque()  # (head, entry) in the order added, for the bound

    def __bool__(self) -> bool:
        return bool(self._lost)

    def add(self, lost: Sequence[Any]) -> None:
        """Watch the `LostPrefix` records of one reclaim."""
        for p in lost:
            if p.still_cached < len(p.tokens):
                head = (p.namespace, p.tokens[0])
                entry = [p.tokens, p.still_cached]
                self._lost.setdefault(head, []).append(entry)
                self._order.append((head, entry))
        while len(self._order) > self.limit:
            self._drop(*self._order.popleft())

    def recomputed(self, tokens: Sequence[int], namespace: Any, cached_len: int) -> int:
        """Tokens of lost prefixes prefilled again for `tokens`: those of each lost prefix it
        covers past `cached_len` (what the tree held of it, in any tier, before the insert)."""
        if not len(tokens):
            return 0
        head = (namespace, tokens[0])
        spans = []  # positions of the request's tokens each lost prefix covers, uncached
        for entry in list(self._lost.get(head, ())):
            lost, still = entry
            common = _common_prefix(tokens, lost)
            if common > max(still, cached_len):
                spans.append((max(still, cached_len), common))
            entry[1] = max(still, common)
            if entry[1] >= len(lost):
                self._drop(head, entry)
        total = end = 0  # the union of the spans (paths share their first tokens)
        for start, stop in sorted(spans):
            total += max(0, stop - max(start, end))
            end = max(end, stop)
        return total


    def _drop(self, head: tuple, entry: list) -> None:
        entries = self._lost.get(head)
        if entries is None:
            return
        for i, e in enumerate(entries):
            if e is entry:
                del entries[i]
                break
        if not entries:
            del self._lost[head]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
