"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from sglang_swift.testing.peer_process import SimGroup


@pytest.fixture
def sims():
    """Simulated control agents in their own processes; all of them end with the test."""
    group = SimGroup()
    try:
        yield group
    finally:
        group.close()


def event(name: str, **match):
    """A predicate on a simulated agent's event: its name and the given fields."""
    return lambda e: e["ev"] == name and all(e.get(k) == v for k, v in match.items())


DETECTION_TIMEOUT_S = 1.0  # the simulated agents' heartbeat timeout (their default)
DETECTION_SLACK_S = 0.5  # scheduling noise on a loaded 2-core machine (ticks every 0.1 s, the kill)


def own_pauses(proc) -> tuple[int, float]:
    """A simulated agent's own pauses so far: (how many, the longest in seconds)."""
    counters = proc.status()["counters"]
    return counters.get("own_pauses", 0), counters.get("max_own_pause_ms", 0) / 1000


def detection_bound(proc, pauses_before: tuple[int, float]) -> float:
    """What liveness.py states: a killed peer is declared dead within the heartbeat timeout of
    the kill plus one tick, later only by the detecting agent's own pauses (a thread that does
    not run detects nothing, and its pauses are not counted against its peers). The slack covers
    the tick and scheduling; a pause of its own since `pauses_before` adds the longest one.
    Measure against `PeerChanged.at`, the verdict's instant, not when the event was printed."""
    count, longest = own_pauses(proc)
    return DETECTION_TIMEOUT_S + DETECTION_SLACK_S + (longest if count > pauses_before[0] else 0.0)


def borrow(donor, borrower, n: int) -> dict:
    """Have `borrower` lease `n` blocks from `donor` once it sees it lendable; the grant event."""
    borrower.status_until(
        lambda st: any(q["agent_id"] == donor.agent_id and q["lendable"] for q in st["peers"])
    )
    start = len(borrower.events)
    borrower.send("request", n=n, donor=donor.agent_id)
    return borrower.wait_for(event("LeaseGranted"), 10, start)
