"""Capacity bookkeeping for the tiers below the device: sets of free indices, nothing more.

The device tier has no class here: SGLang's allocator owns device slots, the tree only records
which node holds which. Every tier below it has the same small interface:
`alloc(num_tokens, preference) -> residency | None`, `free(residency)`, `available_tokens()`,
`capacity_tokens()`, `check_integrity(residencies)`. No memory is touched.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from radix_ext.residency import DONOR, HOST, DonorResidency, HostResidency


class HostTier:
    """A host pool of `capacity` token slots, indices 0..capacity-1, handed out in whole pages of
    `page_size` contiguous, page-aligned slots (a page at slot `s` is `s .. s+page_size-1`, as
    SGLang's host pool and storage backends address it).

    `hold(indices)` marks slots an outside reader still uses (a copy out of them in flight, e.g.
    into L3 storage); a page freed while held returns to the free set only at its last
    `release`."""

    name = HOST

    def __init__(self, capacity: int, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"host page_size must be >= 1, got {page_size}")
        pages = capacity // page_size
        if pages <= 0:
            raise ValueError(f"host capacity must hold at least one page of {page_size} "
                             f"tokens, got {capacity}")
        self.page_size = page_size
        self.capacity = pages * page_size
        # page starts, array('q'), the lowest last: alloc slices the end, free extends it
        self._free = array("q", range(self.capacity - page_size, -1, -page_size))
        self._holds: dict[int, int] = {}  # page start -> holds
        self._parked: set[int] = set()  # freed while held

    def available_tokens(self) -> int:
        return len(self._free) * self.page_size

    def capacity_tokens(self) -> int:
        return self.capacity

    def alloc(self, num_tokens: int, preference: Sequence = ()) -> Optional[HostResidency]:
        """Take `num_tokens` slots (whole pages), or None (and take nothing) when fewer are
        free."""
        page = self.page_size
        if num_tokens % page:
            raise ValueError(f"host alloc of {num_tokens} tokens is not a multiple of the "
                             f"page size {page}")
        k = num_tokens // page
        if k > len(self._free):
            return None
        taken = self._free[len(self._free) - k :]
        del self._free[len(self._free) - k :]
        if page == 1:
            return HostResidency(taken)
        out = array("q")
        for s in taken:
            out.extend(range(s, s + page))
        return HostResidency(out)

    def free(self, res: HostResidency) -> None:
        starts = res.indices[:: self.page_size]
        if not self._holds:
            self._free.extend(starts)
            return
        for s in starts:
            if s in self._holds:
                self._parked.add(s)
            else:
                self._free.append(s)

    def hold(self, indices: Sequence[int]) -> None:
        """Keep the pages of `indices` out of the free set until `release(indices)`."""
        holds = self._holds
        for s in indices[:: self.page_size]:
            holds[s] = holds.get(s, 0) + 1

    def release(self, indices: Sequence[int]) -> None:
        holds = self._holds
        for s in indices[:: self.page_size]:
            n = holds[s] - 1
            if n:
                holds[s] = n
                continue
            del holds[s]
            if s in self._parked:
                self._parked.discard(s)
                self._free.append(s)

    def check_integrity(self, residencies: Iterable[HostResidency]) -> None:
        page = self.page_size
        used = []
        for r in residencies:
            idx = r.indices
            assert len(idx) % page == 0, "host residency not whole pages"
            for j in range(0, len(idx), page):
                s = idx[j]
                assert s % page == 0 and list(idx[j : j + page]) == list(range(s, s + page)), \
                    "host page not contiguous and aligned"
                used.append(s)
        everything = used + list(self._free) + list(self._parked)
        assert len(set(everything)) == len(everything), "host index owned twice"
        assert set(everything) == set(range(0, self.capacity, page)), \
            "host indices lost or invented"


@dataclass
class LeasedBlocks:
    """Memory one donor lends: `num_blocks` blocks under `epoch`. `free_blocks` (array('q'), as
    the residencies cut from it) are the blocks no residency holds, taken from the end.

    `reclaim_hazard` in [0, 1] is how likely the donor wants the memory back before a cached
    prefix is reused (0: stable, 1: almost surely gone); cost-aware policies read it.
    """

    donor: str
    lease_id: int
    epoch: int
    num_blocks: int
    reclaim_hazard: float = 0.0
    free_blocks: array = field(default_factory=lambda: array("q"))

    @property
    def key(self) -> tuple[str, int]:
        return (self.donor, self.lease_id)


class DonorTier:
    """Blocks leased from donor servers; one block holds one page of KV."""

    name = DONOR

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.leases: dict[tuple[str, int], LeasedBlocks] = {}

    def add_lease(
        self, donor: str, lease_id: int, epoch: int, num_blocks: int, reclaim_hazard: float = 0.0
    ) -> LeasedBlocks:
        """Register a lease; its blocks are numbered 0..num_blocks-1 within the lease."""
        if (donor, lease_id) in self.leases:
            raise ValueError(f"lease {donor}/{lease_id} already registered; revoke it first")
        if not 0.0 <= reclaim_hazard <= 1.0:
            raise ValueError(f"reclaim_hazard must be in [0, 1], got {reclaim_hazard}")
        lease = LeasedBlocks(donor, lease_id, epoch, num_blocks, reclaim_hazard)
        lease.free_blocks = array("q", range(num_blocks - 1, -1, -1))
        self.leases[lease.key] = lease
        return lease

    def remove_lease(self, donor: str, lease_id: int) -> None:
        """Forget a lease (after the tree dropped every residency on it)."""
        del self.leases[(donor, lease_id)]

    def remove_blocks(self, donor: str, lease_id: int, blocks: Iterable[int]) -> None:
        """The donor takes these blocks back: they leave the lease for good."""
        lease = self.leases[(donor, lease_id)]
        gone = set(blocks)
        lease.free_blocks = array("q", [b for b in lease.free_blocks if b not in gone])
        lease.num_blocks -= len(gone)

    def available_tokens(self) -> int:
        return sum(len(x.free_blocks) for x in self.leases.values()) * self.page_size

    def capacity_tokens(self) -> int:
        return sum(x.num_blocks for x in self.leases.values()) * self.page_size

    def alloc(self, num_tokens: int,
              preference: Sequence[LeasedBlocks] = ()) -> Optional[DonorResidency]:
        """Blocks for `num_tokens` from the first lease in `preference` (default: most free)
        that can hold them all; None (nothing taken) when no single lease can."""
        need = -(-num_tokens // self.page_size)
        if preference:
            order = preference
        elif len(self.leases) == 1:
            order = self.leases.values()
        else:
            order = sorted(self.leases.values(), key=lambda x: -len(x.free_blocks))
        for lease in order:
            fb = lease.free_blocks
            if len(fb) >= need:
                taken = fb[len(fb) - need :]  # an array slice: the residency's own copy
                del fb[len(fb) - need :]
                return DonorResidency(lease.donor, lease.lease_id, lease.epoch, taken)
        return None

    def free(self, res: DonorResidency) -> None:
        """Return blocks to their lease; a no-op when the lease is gone (revoked)."""
        lease = self.leases.get((res.donor, res.lease))
        if lease is not None and lease.epoch == res.epoch:
            lease.free_blocks.extend(res.blocks)

    def check_integrity(self, residencies: Iterable[DonorResidency]) -> None:
        used: dict[tuple[str, int], list[int]] = {k: [] for k in self.leases}
        for r in residencies:
            key = (r.donor, r.lease)
            assert key in self.leases, f"residency on unknown lease {key}"
            assert self.leases[key].epoch == r.epoch, f"residency from stale epoch on {key}"
            used[key].extend(r.blocks)
        for key, lease in self.leases.items():
            everything = used[key] + list(lease.free_blocks)
            assert len(set(everything)) == len(everything), f"donor block owned twice in {key}"
            assert len(everything) == lease.num_blocks, f"donor blocks lost or invented in {key}"
