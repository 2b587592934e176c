"""The elastic arena's ownership book: which owner holds each fixed-size block.

Owners are strings: FREE (the donor's free pool), a lease id (a borrower), or the donor's own KV.
Every move is a free-list or set operation per block moved: no copy, and no work proportional to
the number of layers or of live blocks. The memory itself (a [num_blocks, block_bytes] uint8
tensor, local or shared) is attached as `memory`; this class never reads or writes it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .geometry import KVGeometry, unused_bytes

FREE = "free"


class ArenaExhausted(RuntimeError):
    """Fewer free blocks than asked for; the caller shrinks the request or evicts first."""


class OwnershipError(ValueError):
    """A block was released or moved by an owner that does not hold it (a bookkeeping bug)."""


class BlockArena:
    def __init__(self, num_blocks: int, block_bytes: int, memory: torch.Tensor | None = None):
        if num_blocks <= 0 or block_bytes <= 0:
            raise ValueError(
                f"arena needs positive num_blocks and block_bytes, got {num_blocks}, {block_bytes}"
            )
        if memory is not None and (
            memory.dtype != torch.uint8 or tuple(memory.shape) != (num_blocks, block_bytes)
        ):
            raise ValueError(
                f"arena memory must be uint8 [{num_blocks}, {block_bytes}], got "
                f"{memory.dtype} {tuple(memory.shape)}"
            )
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.memory = memory
        # Popping from the end hands out low block ids first (readable in logs and tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owner: list[str] = [FREE] * num_blocks
        self._held: dict[str, set[int]] = {}

    # ---- queries -------------------------------------------------------------------------
    def available(self) -> int:
        return len(self._free)

    def owner_of(self, block: int) -> str:
        return self._owner[block]

    def owned(self, owner: str) -> frozenset[int]:
        return frozenset(self._free) if owner == FREE else frozenset(self._held.get(owner, ()))

    def owners(self) -> dict[str, int]:
        """Blocks held per owner, the free pool included."""
        return {FREE: len(self._free), **{o: len(b) for o, b in self._held.items() if b}}

    def fits(self, geometry: KVGeometry) -> int:
        """Unused bytes per block for `geometry`; raises ValueError if its page does not fit."""
        return unused_bytes(geometry, self.block_bytes)

    # ---- moves ---------------------------------------------------------------------------
    def alloc(self, owner: str, n: int) -> list[int]:
        """Move `n` free blocks to `owner`; all or nothing."""
        if owner == FREE:
            raise OwnershipError("alloc to the free pool makes no sense; use release()")
        if n > len(self._free):
            raise ArenaExhausted(
                f"{owner} asked for {n} blocks, {len(self._free)} are free; "
                f"evict or shrink the request"
            )
        got = [self._free.pop() for _ in range(n)]
        held = self._held.setdefault(owner, set())
        for b in got:
            self._owner[b] = owner
            held.add(b)
        return got

    def release(self, owner: str, blocks: Iterable[int]) -> None:
        """Return `owner`'s blocks to the free pool."""
        blocks = list(blocks)
        self._check_held(owner, blocks)
        held = self._held[owner]
        for b in blocks:
            held.discard(b)
            self._owner[b] = FREE
            self._free.append(b)

    def move(self, blocks: Iterable[int], src: str, dst: str) -> None:
        """Hand blocks from one owner to another without touching their bytes."""
        blocks = list(blocks)
        if src == FREE or dst == FREE:
            raise OwnershipError("use alloc()/release() for moves from or to the free pool")
        self._check_held(src, blocks)
        held_src, held_dst = self._held[src], self._held.setdefault(dst, set())
        for b in blocks:
            held_src.discard(b)
            held_dst.add(b)
            self._owner[b] = dst

    def revoke(self, owner: str) -> list[int]:
        """Take every block `owner` holds back to the free pool (lease ended or revoked)."""
        blocks = sorted(self._held.get(owner, ()))
        self.release(owner, blocks)
        self._held.pop(owner, None)
        return blocks

    def _check_held(self, owner: str, blocks: list[int]) -> None:
        held = self._held.get(owner, set())
        bad = [b for b in blocks if b not in held]
        if bad or len(set(blocks)) != len(blocks):
            raise OwnershipError(
                f"{owner} does not hold blocks {bad[:8]} (or repeats a block); nothing was moved"
            )

    # ---- integrity -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every block has exactly one owner, and the owner array agrees with the free list
        and the per-owner sets. Raises AssertionError naming the first inconsistency."""
        seen = [0] * self.num_blocks
        for b in self._free:
            assert 0 <= b < self.num_blocks, f"free list holds out-of-range block {b}"
            assert self._owner[b] == FREE, (
                f"block {b} is on the free list but owned by {self._owner[b]}"
            )
            seen[b] += 1
        for owner, held in self._held.items():
            for b in held:
                assert self._owner[b] == owner, (
                    f"block {b} in {owner}'s set but owned by {self._owner[b]}"
                )
                seen[b] += 1
        for b, count in enumerate(seen):
            assert count == 1, f"block {b} has {count} owners"
