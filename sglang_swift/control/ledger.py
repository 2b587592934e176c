"""The donor's book of its arena blocks: the one record of who owns each donated block.

Pure data: no sockets, no clocks, no threads, no memory (the bytes are the data plane's
`SharedArena`; the book never reads or writes them). Block ids are arena block ids
(docs/dataplane.md, "Block numbers"). The live donor (control/donor.py) keeps one; tests,
benchmarks and the simulator use the same class.

Every block the owner offered has exactly one place: FREE (lendable) or the lease holding it,
either in its ``active`` set (the borrower may read it) or in one of its pending reclaims (the
borrower was asked to stop; the block is *not* reusable yet). A block leaves a lease only on
release, reclaim acknowledgement or the borrower's death, and only then goes back to the free
pool or to the owner. Blocks the owner asked for (``owner_debt``) are handed back as soon as they
become free. Each move costs O(blocks moved): a per-block place index answers "who holds b" in
O(1), and the free pool is a stack that hands out low ids first, so a fresh lease gets
consecutive blocks (the copy path moves runs of consecutive blocks in one pass).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from sglang_swift.control.grant_policy import AllocationPolicy, GreedyPolicy

FREE = 0  # the place of a lendable block; lease ids start at 1


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
    def __init__(self, policy: AllocationPolicy | None = None, reserve: int = 0,
                 cap: int = 0) -> None:
        """`policy` decides grant sizes and reclaim order (greedy when None); `reserve` blocks
        are never lent; `cap` bounds one borrower's blocks (0: no cap)."""
        self.policy, self.reserve, self.cap = policy or GreedyPolicy(), reserve, cap
        self._place: dict[int, int] = {}  # offered block -> FREE or the lease id holding it
        self.free: list[int] = []  # lendable blocks, a stack: the next grant pops from the end
        self.leases: dict[int, GrantedLease] = {}
        self.reclaims: dict[int, PendingReclaim] = {}
        self.owner_debt = 0
        self.unmet: dict[str, tuple[int, int]] = {}  # borrower -> (unmet want, priority)
        self._next_lease = 1
        self._next_reclaim = 1

    # ---- queries ----
    @property
    def offered(self):
        """Every block the owner offered and has not taken back (a set-like view)."""
        return self._place.keys()

    def place_of(self, block: int) -> int | None:
        """FREE, the id of the lease holding `block`, or None when it is not offered."""
        return self._place.get(block)

    def lendable(self) -> int:
        return 0 if self.owner_debt else max(0, len(self.free) - self.reserve)

    def held(self) -> dict[str, int]:
        """Blocks held per borrower (active and under reclaim)."""
        out: dict[str, int] = {}
        for lease in self.leases.values():
            out[lease.borrower] = out.get(lease.borrower, 0) + lease.size
        return out

    # ---- owner side ----
    def offer(self, blocks) -> list[int]:
        """Take blocks from the owner for lending; returns those handed straight back (debt)."""
        blocks = set(blocks)
        dup = [b for b in blocks if b in self._place]
        if dup:
            raise ValueError(f"blocks already offered: {sorted(dup)[:8]}")
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
    def grant(self, borrower: str, epoch: int, want: int, priority: int) -> GrantedLease | None:
        """A new lease of up to ``want`` free blocks (as many as the policy allows), or None."""
        held = self.held()
        self.unmet[borrower] = (want, priority)
        demand = {b: (held.get(b, 0) + w, p) for b, (w, p) in self.unmet.items()}
        capacity = max(0, len(self._place) - self.reserve)
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
        n = min(n, self.lendable())  # a policy that overshoots never lends the reserve
        if n < want:
            self.unmet[borrower] = (want - n, priority)
        else:
            self.unmet.pop(borrower, None)
        if n <= 0:
            return None
        lease = GrantedLease(self._next_lease, borrower, epoch, priority, set())
        self._next_lease += 1
        for _ in range(n):
            block = self.free.pop()
            lease.active.add(block)
            self._place[block] = lease.lease_id
        self.leases[lease.lease_id] = lease
        return lease

    def release(self, borrower: str, lease_id: int, blocks) -> list[int]:
        """Blocks the borrower stopped reading; unknown or foreign ones are ignored (a message
        from a peer is never trusted to name its own blocks). Releasing a block under reclaim
        counts as acknowledging that part of the reclaim."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.borrower != borrower:
            return []
        gone = {b for b in blocks if self._place.get(b) == lease_id}
        lease.active -= gone
        for rid, rb in list(lease.reclaiming.items()):
            if rb & gone:
                rb -= gone
                if rb:
                    self.reclaims[rid] = PendingReclaim(rid, lease_id, borrower, tuple(sorted(rb)))
                else:
                    del lease.reclaiming[rid]
                    del self.reclaims[rid]
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
        """Ask borrowers (in the policy's order) to stop reading ``n`` active blocks."""
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
        """Put `blocks` on the free stack, highest first so the lowest is popped first."""
        for block in sorted(blocks, reverse=True):
            self._place[block] = FREE
            self.free.append(block)
        return self._pay_debt_from_free()

    def _pay_debt_from_free(self) -> list[int]:
        out = []
        while self.owner_debt and self.free:
            block = self.free.pop()
            del self._place[block]
            self.owner_debt -= 1
            out.append(block)
        return out

    def check_integrity(self) -> None:
        """Every offered block has exactly one place, and the place index agrees with the free
        stack, every lease's active set and every pending reclaim. Raises AssertionError naming
        the first inconsistency."""
        found: list[tuple[int, int]] = [(b, FREE) for b in self.free]  # (block, place)
        for lease_id, lease in self.leases.items():
            assert lease.lease_id == lease_id, f"lease {lease.lease_id} filed as {lease_id}"
            assert lease.size, f"empty lease {lease_id} kept"
            found += [(b, lease_id) for b in lease.active]
            for rid, blocks in lease.reclaiming.items():
                rec = self.reclaims.get(rid)
                assert rec is not None and rec.lease_id == lease_id, (
                    f"reclaim {rid} of lease {lease_id} is not pending"
                )
                assert set(rec.blocks) == blocks, f"reclaim {rid} lists other blocks"
                found += [(b, lease_id) for b in blocks]
        seen: dict[int, int] = {}
        for block, place in found:
            assert block not in seen, (
                f"block {block} is in two places: {seen[block]} and {place} (0 = free)"
            )
            seen[block] = place
        for block, place in seen.items():
            assert self._place.get(block) == place, (
                f"block {block} found in place {place} but the index says "
                f"{self._place.get(block)} (0 = free, None = not offered)"
            )
        assert len(seen) == len(self._place), (
            f"blocks offered but in no place: {sorted(set(self._place) - set(seen))[:8]}"
        )
        assert len(self.reclaims) == sum(len(ls.reclaiming) for ls in self.leases.values())
        assert self.owner_debt >= 0 and (not self.owner_debt or not self.free)
