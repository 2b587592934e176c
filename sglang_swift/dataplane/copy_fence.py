"""`CopyFence`: which blocks of one lease no copy may touch any more, and which copies still may.

A borrower acknowledges a reclaim from its control agent's thread, without waiting for its
scheduler loop (docs/liveness.md "Fenced reclaim acknowledgement"). Copies begin on the scheduler
thread and run on the copy lane, so the agent's thread needs a way to (a) stop later copies from
touching the reclaimed blocks and (b) find the copies already running on them. Both go through
one lock:

* `admit(copy, blocks)`: refuse a copy touching a fenced block, else register it as live;
* `fence(blocks)`: fence the blocks and return the live copies touching them (the caller aborts
  them and waits until they touch no memory);
* `retire(copy)`: the copy touches no memory any more (its lane job returned);
* `fenced_since(generation, blocks)`: whether a fence touched `blocks` after `generation`
  (`generation` read when the copy began): the after-copy validity check of a copy whose lane
  job already retired (a GPU copy is retired once enqueued, before it ran).

Race-freedom: a copy is either admitted before the fence took the lock (then `fence` returns it)
or after (then `admit` refuses it); it can never be missed by both. A fenced block stays fenced
for the fence's life: the donor has it back and the lease never holds it again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any


class CopyFence:
    """Fenced blocks and live copies of one lease; every method is thread-safe and O(copies +
    blocks) under one short lock (no waiting inside)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fenced: set[int] = set()
        self._live: dict[Any, frozenset[int]] = {}
        self.generation = 0  # fences so far; read without the lock (an int, set under it)

    def admit(self, copy: Any, blocks: Iterable[int]) -> bool:
        """Register `copy` as touching `blocks`; False (nothing registered) if any is fenced."""
        mine = frozenset(int(b) for b in blocks)
        with self._lock:
            if not self._fenced.isdisjoint(mine):
                return False
            self._live[copy] = mine
            return True

    def retire(self, copy: Any) -> None:
        """`copy` touches no memory any more (idempotent)."""
        with self._lock:
            self._live.pop(copy, None)

    def fence(self, blocks: Iterable[int]) -> list[Any]:
        """Fence `blocks`: later `admit`s touching them fail. Returns the live copies touching
        them; the caller must stop those before it lets anyone reuse the blocks."""
        mine = {int(b) for b in blocks}
        with self._lock:
            self._fenced |= mine
            self.generation += 1
            return [copy for copy, used in self._live.items() if not used.isdisjoint(mine)]

    def touches(self, blocks: Iterable[int]) -> bool:
        """Whether any of `blocks` is fenced."""
        with self._lock:
            return not self._fenced.isdisjoint(int(b) for b in blocks)

    def fenced_since(self, generation: int, blocks: Iterable[int]) -> bool:
        """Whether any of `blocks` is fenced, when a fence ran after `generation` (O(1) when
        none did: the steady state)."""
        if self.generation == generation:
            return False
        return self.touches(blocks)

    def live(self) -> int:
        """Copies admitted and not retired yet."""
        with self._lock:
            return len(self._live)
