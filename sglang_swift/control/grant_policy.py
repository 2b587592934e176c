"""Allocation policies: how many blocks a donor grants each borrower, and whom it reclaims from.

A policy is a small strategy object chosen by name (``ControlConfig.policy``); the ledger asks
it and does the bookkeeping. Policies see only counts, never sockets or clocks.
"""

from __future__ import annotations

import math
from typing import Protocol

from sglang_swift.control.control_config import ControlConfigError


class LeaseView(Protocol):
    lease_id: int
    borrower: str
    priority: int

    @property
    def num_active(self) -> int: ...


class AllocationPolicy(Protocol):
    name: str

    def grant_size(
        self,
        borrower: str,
        want: int,
        priority: int,
        *,
        held: dict[str, int],
        demand: dict[str, tuple[int, int]],
        capacity: int,
        available: int,
        cap: int,
    ) -> int:
        """Blocks to grant now (0..min(want, available)). ``held``: active blocks per borrower;
        ``demand``: (held + unmet want, priority) per borrower incl. this one; ``capacity``:
        blocks the donor lends in total (offered minus reserve); ``cap``: per-borrower cap or 0."""
        ...

    def reclaim_order(self, leases: list[LeaseView], held: dict[str, int]) -> list[LeaseView]:
        """Leases in the order their blocks are taken back when the donor needs memory."""
        ...


def _bounded(n: int, want: int, available: int, held: int, cap: int) -> int:
    if cap:
        n = min(n, cap - held)
    return max(0, min(n, want, available))


class GreedyPolicy:
    """First come, first served, up to the per-borrower cap."""

    name = "greedy"

    def grant_size(self, borrower, want, priority, *, held, demand, capacity, available, cap):
        return _bounded(want, want, available, held.get(borrower, 0), cap)

    def reclaim_order(self, leases, held):
        return sorted(leases, key=lambda ls: (ls.priority, -ls.lease_id))


class ProportionalPolicy:
    """Each borrower's share of capacity is proportional to its demand (held + unmet want),
    weighted by priority + 1, never above its demand nor the per-borrower cap. Reclaims hit
    low priority first, then the borrowers holding the most."""

    name = "proportional"

    def grant_size(self, borrower, want, priority, *, held, demand, capacity, available, cap):
        total = sum(d * (p + 1) for d, p in demand.values()) or 1
        d, p = demand.get(borrower, (want, priority))
        share = min(d, math.ceil(capacity * d * (p + 1) / total))
        mine = held.get(borrower, 0)
        return _bounded(share - mine, want, available, mine, cap)

    def reclaim_order(self, leases, held):
        return sorted(leases, key=lambda ls: (ls.priority, -held.get(ls.borrower, 0), -ls.lease_id))


POLICIES: dict[str, type] = {p.name: p for p in (GreedyPolicy, ProportionalPolicy)}


def create_policy(name: str) -> AllocationPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ControlConfigError(
            f"unknown allocation policy {name!r}; choose from {sorted(POLICIES)}"
        ) from None
