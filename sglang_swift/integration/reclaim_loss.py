"""What a reclaim cost: tokens that were in the donor tier when a donor took its pages back, and
that a later request had to prefill again because they were no longer cached anywhere.

A reclaim's `RevokeResult.lost` names each subtree that lost its last copy (with a host tier, only
what the rescue found no host room for). `ReclaimLoss` keeps those prefixes and, on each match,
counts the tokens of a lost prefix the request asks for beyond what the match found cached; once
counted, those tokens are cached again by that request's prefill, so they are not counted twice.
Bounded: at most MAX_PREFIXES prefixes are watched (the oldest go first), and a prefix is dropped
once every token of it was asked for again. Runs on the scheduler thread.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

MAX_PREFIXES = 512


class ReclaimLoss:
    def __init__(self, limit: int = MAX_PREFIXES):
        self._lost: deque = deque(maxlen=limit)  # [namespace, tokens, tokens still cached]

    def __bool__(self) -> bool:
        return bool(self._lost)

    def add(self, lost: Sequence[Any]) -> None:
        """Watch the `LostPrefix` records of one reclaim."""
        for p in lost:
            if p.still_cached < len(p.tokens):
                self._lost.append([p.namespace, p.tokens, p.still_cached])

    def recomputed(self, tokens: Sequence[int], namespace: Any, cached_len: int) -> int:
        """Tokens of lost prefixes a request for `tokens` must prefill again: those of each
        lost prefix it covers past `cached_len` (what its match found in any tier)."""
        spans = []  # positions of the request's tokens each lost prefix covers, uncached
        keep = []
        for entry in self._lost:
            ns, lost, still = entry
            if ns == namespace:
                common = _common_prefix(tokens, lost)
                if common > max(still, cached_len):
                    spans.append((max(still, cached_len), common))
                entry[2] = max(still, common)
            if entry[2] < len(entry[1]):
                keep.append(entry)
        if len(keep) != len(self._lost):
            self._lost = deque(keep, maxlen=self._lost.maxlen)
        total = end = 0  # the union of the spans (paths share their first tokens)
        for start, stop in sorted(spans):
            total += max(0, stop - max(start, end))
            end = max(end, stop)
        return total


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
