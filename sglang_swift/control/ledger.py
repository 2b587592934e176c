"""Donor-side bookkeeping of donated blocks. Pure data: no sockets, no clocks, no threads.

Every block the owner offered is in exactly one place: ``free`` (lendable), a lease's
``active`` set (the borrower may read it), or a lease's pending reclaim (the borrower was asked
to stop; the block is *not* reusable yet). A block leaves a lease only on release, reclaim
acknowledgement or the borrower's death, and only then goes back to ``free`` or to the owner.
Blocks the owner asked for (``owner_debt``) are handed back as soon as they become free.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from sglang_swift.control.grant_policy import AllocationPolicy


@dataclass
class GrantedLease:
    lease_id: int
    borrower: str
    borrower_epoch: int
    priority: int
    active: set[int]
    reclaiming: dict[int, set[int]] = field(default_factory=dict)  # reclaim_id -> blocks

    @property
    def num_active(self) -> int:
        return len(self.active)

    @property
    def size(self) -> int:
        return len(self.active) + sum(len(b) for b in self.reclaiming.values())

    def all_blocks(self) -> set[int]:
        return self.active.union(*self.reclaiming.values())


@dataclass(frozen=True)
class PendingReclaim:
    reclaim_id: int
    lease_id: int
    borrower: str
    blocks: tuple[int, ...]


class DonorLedger:
    def __init__(self, policy: AllocationPolicy, reserve: int = 0, cap: int = 0) -> None:
        self.policy, self.reserve, self.cap = policy, reserve, cap
        self.offered: set[int] = set()
        self.free: set[int] = set()
        self.leases: dict[int, GrantedLease] = {}
        self.reclaims: dict[int, PendingReclaim] = {}
        self.owner_debt = 0
        self.unmet: dict[str, tuple[int, int]] = {}  # borrower -> (unmet want, priority)
        self._next_lease = 1
        self._next_reclaim = 1

    # ---- owner side ----
    def offer(self, blocks) -> list[int]:
        """Take blocks from the owner for lending; returns those handed straight back (debt)."""
        blocks = set(blocks)
        dup = blocks & self.offered
        if dup:
            raise ValueError(f"blocks already offered: {sorted(dup)[:8]}")
        self.offered |= blocks
        return self._free_blocks(blocks)

    def demand(self, n: int) -> tuple[list[int], list[PendingReclaim]]:
        """The owner needs ``n`` blocks back: free ones now, the rest through reclaims."""
        self.owner_debt += n
        now = self._pay_debt_from_free()
        return now, self.reclaim_for_debt()

    def reclaim_for_debt(self) -> list[PendingReclaim]:
        in_flight = sum(len(r.blocks) for r in self.reclaims.values())
        return self.start_reclaims(self.owner_debt - in_flight)

    # ---- borrower side ----
    def lendable(self) -> int:
        return 0 if self.owner_debt else max(0, len(self.free) - self.reserve)

    def held(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lease in self.leases.values():
            out[lease.borrower] = out.get(lease.borrower, 0) + lease.size
        return out

    def grant(self, borrower: str, epoch: int, want: int, priority: int) -> GrantedLease | None:
        held = self.held()
        self.unmet[borrower] = (want, priority)
        demand = {b: (held.get(b, 0) + w, p) for b, (w, p) in self.unmet.items()}
        capacity = max(0, len(self.offered) - self.reserve)
        n = self.policy.grant_size(
            borrower,
            want,
            priority,
            held=held,
            demand=demand,
            capacity=capacity,
            available=self.lendable(),
            cap=self.cap,
        )
        if n < want:
            self.unmet[borrower] = (want - n, priority)
        else:
            self.unmet.pop(borrower, None)
        if n <= 0:
            return None
        blocks = set(itertools.islice(self.free, n))  # any free blocks; O(n), not O(pool)
        self.free -= blocks
        lease = GrantedLease(self._next_lease, borrower, epoch, priority, blocks)
        self._next_lease += 1
        self.leases[lease.lease_id] = lease
        return lease

    def release(self, borrower: str, lease_id: int, blocks) -> list[int]:
        """Blocks the borrower stopped reading; unknown or foreign ones are ignored."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.borrower != borrower:
            return []
        gone = set(blocks) & lease.all_blocks()
        lease.active -= gone
        for rid, rb in list(lease.reclaiming.items()):
            rb -= gone
            if not rb:
                del lease.reclaiming[rid]
                del self.reclaims[rid]
            else:
                self.reclaims[rid] = PendingReclaim(rid, lease_id, borrower, tuple(sorted(rb)))
        self._drop_if_empty(lease)
        return self._free_blocks(gone)

    def ack(self, borrower: str, reclaim_id: int, lease_id: int) -> list[int]:
        """The borrower stopped reading a reclaim's blocks. Stale or foreign acks do nothing."""
        rec = self.reclaims.get(reclaim_id)
        if rec is None or rec.borrower != borrower or rec.lease_id != lease_id:
            return []
        del self.reclaims[reclaim_id]
        lease = self.leases[lease_id]
        blocks = lease.reclaiming.pop(reclaim_id)
        self._drop_if_empty(lease)
        return self._free_blocks(blocks)

    def drop_borrower(self, borrower: str) -> list[int]:
        """The borrower is dead (or left): all its blocks are free to reuse."""
        freed: set[int] = set()
        for lease in [ls for ls in self.leases.values() if ls.borrower == borrower]:
            freed |= lease.all_blocks()
            for rid in lease.reclaiming:
                del self.reclaims[rid]
            del self.leases[lease.lease_id]
        self.unmet.pop(borrower, None)
        return self._free_blocks(freed)

    def start_reclaims(self, n: int) -> list[PendingReclaim]:
        out: list[PendingReclaim] = []
        for lease in self.policy.reclaim_order(list(self.leases.values()), self.held()):
            if n <= 0:
                break
            if not lease.active:
                continue
            take = set(itertools.islice(lease.active, n))
            lease.active -= take
            rec = PendingReclaim(
                self._next_reclaim, lease.lease_id, lease.borrower, tuple(sorted(take))
            )
            self._next_reclaim += 1
            lease.reclaiming[rec.reclaim_id] = take
            self.reclaims[rec.reclaim_id] = rec
            out.append(rec)
            n -= len(take)
        return out

    # ---- internals ----
    def _drop_if_empty(self, lease: GrantedLease) -> None:
        if not lease.active and not lease.reclaiming:
            del self.leases[lease.lease_id]

    def _free_blocks(self, blocks) -> list[int]:
        self.free |= set(blocks)
        return self._pay_debt_from_free()

    def _pay_debt_from_free(self) -> list[int]:
        if not self.owner_debt or not self.free:
            return []
        out = list(itertools.islice(self.free, self.owner_debt))
        self.free -= set(out)
        self.offered -= set(out)
        self.owner_debt -= len(out)
        return out

    def check_integrity(self) -> None:
        seen = set(self.free)
        for lease in self.leases.values():
            blocks = lease.all_blocks()
            total = len(lease.active) + sum(len(b) for b in lease.reclaiming.values())
            assert total == len(blocks), f"lease {lease.lease_id} lists a block twice"
            assert not (seen & blocks), f"block in two places: {sorted(seen & blocks)[:8]}"
            assert blocks, f"empty lease {lease.lease_id} kept"
            seen |= blocks
            for rid in lease.reclaiming:
                assert self.reclaims[rid].lease_id == lease.lease_id
        assert seen == self.offered, "offered blocks lost or invented"
        assert len(self.reclaims) == sum(len(ls.reclaiming) for ls in self.leases.values())
        assert self.owner_debt >= 0 and (not self.owner_debt or not self.free)
