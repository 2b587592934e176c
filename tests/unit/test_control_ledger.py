"""Donor ledger and allocation policies: a block is in exactly one place, a reclaimed block is
never reusable before its acknowledgement (or the borrower's death), the owner always wins."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_swift.control.control_config import ControlConfigError
from sglang_swift.control.ledger import DonorLedger
from sglang_swift.control.grant_policy import create_policy


def _ledger(n: int = 16, reserve: int = 0, cap: int = 0, policy: str = "greedy") -> DonorLedger:
    led = DonorLedger(create_policy(policy), reserve, cap)
    led.offer(range(n))
    return led


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
