"""The donor's book of its blocks (DonorLedger, the one owner book: live donor, tests, benchmarks
and simulator) and the allocation policies: a block is in exactly one place, a reclaimed block is
never reusable before its acknowledgement (or the borrower's death), the owner always wins."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_swift.control.control_config import ControlConfigError
from sglang_swift.control.grant_policy import create_policy
from sglang_swift.control.ledger import FREE, DonorLedger


def _ledger(n: int = 16, reserve: int = 0, cap: int = 0, policy: str = "greedy") -> DonorLedger:
    led = DonorLedger(create_policy(policy), reserve, cap)
    led.offer(range(n))
    return led


def _snapshot(led: DonorLedger):
    leases = {i: (ls.borrower, sorted(ls.active), sorted(ls.reclaiming))
              for i, ls in led.leases.items()}
    return sorted(led.free), leases, dict(led._place), led.owner_debt  # noqa: SLF001


def test_every_move_keeps_exactly_one_place_per_block():
    """Invariant: grants, reclaims, acks, releases and a borrower's death each move blocks
    between places and never leave one in two places or none; `place_of` says where a block is;
    the free pool hands out low ids first, so a fresh lease is one run of consecutive blocks."""
    led = _ledger(10)
    a = led.grant("a", 1, 4, 0)
    b = led.grant("b", 1, 3, 0)
    led.check_integrity()
    assert sorted(a.active) == [0, 1, 2, 3] and sorted(b.active) == [4, 5, 6]
    assert {led.place_of(x) for x in a.active} == {a.lease_id} and led.place_of(9) == FREE
    assert led.place_of(10) is None and led.held() == {"a": 4, "b": 3}
    # the donor takes 5 blocks back for its own KV: the 3 free ones now, 2 through a reclaim
    now, (rec,) = led.demand(5)
    assert sorted(now) == [7, 8, 9] and led.place_of(7) is None and 7 not in led.offered
    assert rec.lease_id == b.lease_id and len(rec.blocks) == 2  # greedy: the newest lease first
    assert {led.place_of(x) for x in rec.blocks} == {b.lease_id}  # still b's until acked
    led.check_integrity()
    assert sorted(led.ack("b", rec.reclaim_id, rec.lease_id)) == sorted(rec.blocks)
    assert len(led.offered) == 5 and led.owner_debt == 0
    assert led.release("a", a.lease_id, [0]) == [] and led.place_of(0) == FREE
    assert sorted(led.drop_borrower("a")) == [] and sorted(led.free) == [0, 1, 2, 3]
    led.check_integrity()
    again = led.grant("c", 1, 4, 0)  # the released run comes back whole
    assert sorted(again.active) == [0, 1, 2, 3]
    led.check_integrity()


def test_foreign_or_bad_moves_change_nothing():
    """Invariant: a release on a lease the borrower does not hold, of another lease's blocks or
    of blocks never offered, and a stale ack move nothing; offering a block twice is refused;
    a grant larger than the free pool gets what is free, then nothing."""
    led = _ledger(4)
    x = led.grant("x", 1, 2, 0)
    y = led.grant("y", 1, 1, 0)
    before = _snapshot(led)
    assert led.release("y", x.lease_id, set(x.active)) == []
    assert led.release("x", x.lease_id, y.active | {99}) == []
    assert led.release("x", 77, set(x.active)) == []
    assert led.ack("x", 7, x.lease_id) == []
    with pytest.raises(ValueError, match="already offered"):
        led.offer([0, 50])
    assert _snapshot(led) == before and 50 not in led.offered
    z = led.grant("z", 1, 3, 0)
    assert len(z.active) == 1 and led.lendable() == 0 and led.grant("w", 1, 1, 0) is None
    led.check_integrity()


def test_check_integrity_names_a_block_in_two_places_or_a_wrong_index():
    """Invariant: check_integrity catches a block listed twice (a leased block also on the free
    stack) and a place index that disagrees with where the block is, naming the block."""
    led = _ledger(4)
    lease = led.grant("x", 1, 1, 0)
    (held,) = lease.active
    led.free.append(held)  # corrupt the book on purpose
    with pytest.raises(AssertionError, match=f"block {held} is in two places"):
        led.check_integrity()
    led.free.remove(held)
    led._place[led.free[0]] = lease.lease_id  # noqa: SLF001 - the index lies about a free block
    with pytest.raises(AssertionError, match=f"block {led.free[0]} found in place 0"):
        led.check_integrity()


def test_the_book_never_sees_memory():
    """Invariant: the ledger is pure bookkeeping: importing it loads no torch, so it cannot read
    or write the blocks it accounts for (the data plane's SharedArena holds the bytes)."""
    code = "import sys, sglang_swift.control.ledger; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_grant_then_release_returns_blocks_to_the_pool():
    """Released blocks are lendable again; the lease disappears."""
    led = _ledger()
    lease = led.grant("b", 1, 4, 0)
    assert len(lease.active) == 4 and led.lendable() == 12
    assert led.release("b", lease.lease_id, lease.active.copy()) == []
    assert led.lendable() == 16 and not led.leases
    led.check_integrity()


def test_reclaimed_blocks_are_not_reusable_before_the_ack():
    """Between reclaim and ack the blocks are neither free, lendable nor the owner's."""
    led = _ledger(8)
    lease = led.grant("b", 1, 8, 0)
    now, reclaims = led.demand(3)
    assert now == [] and sum(len(r.blocks) for r in reclaims) == 3
    assert not led.free and led.lendable() == 0
    assert led.grant("c", 1, 1, 0) is None
    rec = reclaims[0]
    assert led.ack("someone-else", rec.reclaim_id, rec.lease_id) == []  # foreign ack
    assert led.ack("b", rec.reclaim_id + 99, rec.lease_id) == []  # unknown reclaim
    back = led.ack("b", rec.reclaim_id, rec.lease_id)
    assert sorted(back) == sorted(rec.blocks) and not set(back) & lease.active
    assert led.ack("b", rec.reclaim_id, rec.lease_id) == []  # duplicate ack is harmless
    led.check_integrity()


def test_owner_demand_takes_free_blocks_first_including_the_reserve():
    """The owner's demand is served from free blocks (reserve too) before any reclaim."""
    led = _ledger(10, reserve=2)
    led.grant("b", 1, 100, 0)
    assert led.lendable() == 0 and len(led.free) == 2  # the reserve is never lent
    now, reclaims = led.demand(3)
    assert len(now) == 2 and len(reclaims) == 1 and len(reclaims[0].blocks) == 1
    led.check_integrity()


def test_dead_borrower_frees_everything_including_pending_reclaims():
    """Declaring a borrower dead makes its blocks reusable at once and pays the owner first."""
    led = _ledger(8)
    led.grant("b", 1, 8, 0)
    _, reclaims = led.demand(2)
    back = led.drop_borrower("b")
    assert len(back) == 2 and len(led.free) == 6 and not led.reclaims
    led.check_integrity()


def test_release_of_blocks_under_reclaim_counts_as_ack():
    """A borrower may release blocks it was asked to give back; the reclaim completes."""
    led = _ledger(4)
    lease = led.grant("b", 1, 4, 0)
    _, (rec,) = led.demand(1)
    assert led.release("b", lease.lease_id, rec.blocks) == list(rec.blocks)
    assert not led.reclaims
    led.check_integrity()


def test_proportional_policy_splits_by_demand_and_respects_caps():
    """Two borrowers with equal demand get equal halves; the cap bounds each one."""
    led = _ledger(20, policy="proportional")
    led.unmet["c"] = (20, 0)  # c has asked too
    a = led.grant("a", 1, 20, 0)
    assert len(a.active) == 10
    capped = _ledger(20, cap=3, policy="proportional")
    assert len(capped.grant("a", 1, 20, 0).active) == 3
    assert capped.grant("a", 1, 1, 0) is None
    with pytest.raises(ControlConfigError):
        create_policy("lottery")


def test_reclaims_hit_low_priority_first():
    """When the owner needs memory, low-priority leases are reclaimed first."""
    led = _ledger(8, policy="proportional")
    hi = led.grant("hi", 1, 4, 2)
    lo = led.grant("lo", 1, 4, 0)
    _, reclaims = led.demand(4)
    assert {r.lease_id for r in reclaims} == {lo.lease_id} and hi.active


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from(["greedy", "proportional"]))
def test_random_operation_sequences_keep_the_ledger_consistent(seed, policy):
    """Any interleaving of grants, releases, reclaims, acks, deaths and offers keeps every
    block in exactly one place, and no block is ever in two leases."""
    rng = random.Random(seed)
    led = _ledger(32, reserve=rng.randint(0, 4), cap=rng.randint(0, 12), policy=policy)
    owner: set[int] = set()
    for _ in range(60):
        op = rng.randrange(6)
        if op == 0:
            led.grant(rng.choice("abc"), 1, rng.randint(1, 10), rng.randint(0, 2))
        elif op == 1 and led.leases:
            lease = rng.choice(list(led.leases.values()))
            blocks = rng.sample(sorted(lease.all_blocks()), k=1)
            owner |= set(led.release(lease.borrower, lease.lease_id, blocks))
        elif op == 2:
            now, _ = led.demand(rng.randint(1, 6))
            owner |= set(now)
        elif op == 3 and led.reclaims:
            rec = rng.choice(list(led.reclaims.values()))
            owner |= set(led.ack(rec.borrower, rec.reclaim_id, rec.lease_id))
        elif op == 4:
            owner |= set(led.drop_borrower(rng.choice("abc")))
        elif op == 5 and owner:
            give = set(rng.sample(sorted(owner), k=min(len(owner), 4)))
            owner -= give
            owner |= set(led.offer(give))
        led.check_integrity()
        assert not owner & led.offered, "a block is both the owner's and the ledger's"
