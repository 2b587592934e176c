"""Faults between real processes: SIGKILL of a donor and of a borrower mid-lease, and
restarts that rejoin with a new epoch. Nothing waits forever; every process is ended."""

from __future__ import annotations

import time

import pytest
from integration.conftest import DETECTION_SLACK_S, DETECTION_TIMEOUT_S
from integration.conftest import borrow as _borrow
from integration.conftest import detection_bound as _detection_bound
from integration.conftest import event as _ev
from integration.conftest import own_pauses as _pauses

pytestmark = pytest.mark.integration

TIMEOUT, SLACK = DETECTION_TIMEOUT_S, DETECTION_SLACK_S  # conftest: the agents' default


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
