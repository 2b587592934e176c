"""Token keys: page-aligned comparison of `array('q')` keys (the tree's hot path)."""

from __future__ import annotations

from array import array
from typing import Sequence


def as_array(seq: Sequence[int]) -> array:
    return seq if type(seq) is array else array("q", seq)


def common_len(a: array, b: array, pos: int, n: int, page: int) -> int:
    """Length of the common prefix of `a` and `b[pos:n]`, rounded down to a page."""
    m = min(len(a), n - pos)
    if a[:m] == b[pos : pos + m]:
        return m - m % page
    lo, hi = 0, m  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid
    return lo - lo % page
