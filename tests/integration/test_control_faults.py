"""Faults between real processes: SIGKILL of a donor and of a borrower mid-lease, and
restarts that rejoin with a new epoch. Nothing waits forever; every process is ended."""

from __future__ import annotations

import time

import pytest

from integration.conftest import event as _ev

pytestmark = pytest.mark.integration

TIMEOUT = 1.0  # the default heartbeat timeout
SLACK = 0.5  # scheduling noise on a loaded 2-core machine (ticks every 0.1 s, the kill itself)


def _pauses(proc) -> tuple[int, float]:
    """The agent's own pauses so far: (how many, the longest in seconds)."""
    counters = proc.status()["counters"]
    return counters.get("own_pauses", 0), counters.get("max_own_pause_ms", 0) / 1000


def _detection_bound(proc, pauses_before: tuple[int, float]) -> float:
    """What liveness.py states: a killed peer is declared dead within the heartbeat timeout of
    the kill plus one tick, later only by the detecting agent's own pauses (a thread that does
    not run detects nothing). Slack covers the tick and scheduling; a pause of its own since
    `pauses_before` adds the longest one. Measured against `PeerChanged.at`, the verdict's
    instant, not against when the simulated agent's event pump printed it."""
    count, longest = _pauses(proc)
    return TIMEOUT + SLACK + (longest if count > pauses_before[0] else 0.0)


def _borrow(donor, borrower, n: int) -> dict:
    borrower.status_until(
        lambda st: any(q["agent_id"] == donor.agent_id and q["lendable"] for q in st["peers"])
    )
    start = len(borrower.events)
    borrower.send("request", n=n, donor=donor.agent_id)
    return borrower.wait_for(_ev("LeaseGranted"), 10, start)


def test_killed_donor_is_detected_within_the_heartbeat_timeout(sims):
    """SIGKILL a donor: its borrower drops the lease within the timeout, stops reading, and
    borrows again from the donor's next incarnation, which has a larger epoch."""
    donor = sims.start("donor", "--donate", "32", "--block-bytes", "1024")
    borrower = sims.start("borrower", "--readers", "1")
    grant = _borrow(donor, borrower, 8)
    pauses = _pauses(borrower)
    killed_at = time.monotonic()
    donor.kill()
    lost = borrower.wait_for(_ev("LeaseLost"), TIMEOUT + SLACK + 5)
    assert lost["key"] == grant["key"] and sorted(lost["blocks"]) == sorted(grant["blocks"])
    assert lost["reason"] == "heartbeat timeout", lost
    gone = borrower.wait_for(
        _ev("PeerChanged", agent_id="donor", epoch=donor.epoch, joined=False), 5
    )
    assert gone["reason"] == "heartbeat timeout"
    assert gone["at"] - killed_at <= _detection_bound(borrower, pauses), (gone, lost)
    assert borrower.ask("stats", "stats")["read_violations"] == 0

    reborn = sims.start("donor", "--donate", "32", "--block-bytes", "1024")
    assert reborn.epoch > donor.epoch
    borrower.wait_for(_ev("PeerChanged", agent_id="donor", epoch=reborn.epoch, joined=True), 10)
    again = _borrow(reborn, borrower, 8)
    assert again["key"][1] == reborn.epoch
    assert borrower.ask("integrity", "integrity")["ok"]


def test_killed_borrower_is_detected_and_its_blocks_reclaimed(sims):
    """SIGKILL a borrower: its donor declares it dead within the timeout and gets all its
    blocks back, reusable at once."""
    donor = sims.start("donor", "--donate", "32")
    borrower = sims.start("borrower")
    _borrow(donor, borrower, 20)
    donor.status_until(lambda st: st["lent"] == 20)
    pauses = _pauses(donor)
    killed_at = time.monotonic()
    borrower.kill()
    gone = donor.wait_for(
        _ev("PeerChanged", agent_id="borrower", joined=False), TIMEOUT + SLACK + 5
    )
    assert gone["reason"] == "heartbeat timeout"
    assert gone["at"] - killed_at <= _detection_bound(donor, pauses), gone
    assert donor.status()["lent"] == 0
    donor.send("demand", n=32)
    assert len(donor.wait_for(_ev("BlocksReturned"), 5)["blocks"]) == 32
    assert donor.ask("integrity", "integrity")["ok"]


def test_restarted_borrower_rejoins_with_a_new_epoch(sims):
    """A borrower that restarts before the timeout is recognised by its new epoch: the donor
    frees the old incarnation's leases at once, and the new one borrows normally."""
    donor = sims.start("donor", "--donate", "32", "--heartbeat-timeout", "30")
    first = sims.start("borrower", "--heartbeat-timeout", "30")
    _borrow(donor, first, 10)
    first.kill()
    second = sims.start("borrower", "--heartbeat-timeout", "30")
    assert second.epoch > first.epoch
    gone = donor.wait_for(
        _ev("PeerChanged", agent_id="borrower", epoch=first.epoch, joined=False), 10
    )
    assert gone["reason"] == "restarted"
    donor.status_until(lambda st: st["lent"] == 0)
    grant = _borrow(donor, second, 32)
    assert len(grant["blocks"]) == 32
    assert donor.ask("integrity", "integrity")["ok"]


def test_donor_that_leaves_cleanly_voids_leases_at_once(sims):
    """A donor that quits says goodbye: its borrower drops the lease without waiting."""
    donor = sims.start("donor", "--donate", "8", "--heartbeat-timeout", "30")
    borrower = sims.start("borrower", "--heartbeat-timeout", "30")
    _borrow(donor, borrower, 8)
    donor.close()
    assert borrower.wait_for(_ev("LeaseLost"), 5)["reason"] == "left"
