"""Liveness between real processes: an agent process stopped (SIGSTOP) for several heartbeat
timeouts keeps its leases, blocks and peers; a process that dies is still detected within the
heartbeat timeout, and what it left in the rendezvous directory is swept by its peer."""

from __future__ import annotations

import os
import signal
import time

import pytest
from integration.conftest import DETECTION_SLACK_S, DETECTION_TIMEOUT_S
from integration.conftest import borrow as _borrow
from integration.conftest import detection_bound as _detection_bound
from integration.conftest import event as _ev
from integration.conftest import own_pauses as _pauses

pytestmark = pytest.mark.integration

TIMEOUT, SLACK = DETECTION_TIMEOUT_S, DETECTION_SLACK_S  # conftest: the agents' default
PAUSE = 3.0  # a stop three times that long; the old liveness dropped every lease after 0.75 s


def _lost_events(proc) -> list[dict]:
    return [
        e
        for e in proc.events
        if e["ev"] == "LeaseLost" or (e["ev"] == "PeerChanged" and not e["joined"])
    ]


def _pause(proc, seconds: float, watcher, check) -> dict:
    """SIGSTOP `proc` for `seconds`; halfway, `check(watcher.status())` must hold."""
    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds / 2)  # the stop under test, not a wait for an event
        seen = watcher.status()
        assert check(seen), seen
        time.sleep(seconds / 2)
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
    return seen


def test_a_stopped_borrower_keeps_its_lease_blocks_and_reads(sims):
    """SIGSTOP a reading borrower for three heartbeat timeouts: its donor suspects it but keeps
    the lease; after SIGCONT the borrower holds the same lease and blocks, reads them again,
    and no read ever saw a block the donor had reused."""
    donor = sims.start("donor", "--donate", "32", "--block-bytes", "1024", "--scribble")
    borrower = sims.start("borrower", "--readers", "1")
    grant = _borrow(donor, borrower, 8)
    donor.status_until(lambda st: st["lent"] == 8)
    seen = _pause(
        borrower,
        PAUSE,
        donor,
        lambda st: st["lent"] == 8 and [q["suspect"] for q in st["peers"]] == [True],
    )
    assert seen["counters"].get("suspicions", 0) >= 1
    reads = borrower.ask("stats", "stats")["reads"]
    after = borrower.status_until(lambda st: not st["peers"][0]["suspect"])
    assert [(ls["donor"], ls["epoch"], ls["lease_id"]) for ls in after["leases"]] == [
        tuple(grant["key"])
    ]
    assert after["leases"][0]["num_blocks"] == 8
    assert not _lost_events(borrower) and not _lost_events(donor)
    deadline = time.monotonic() + 10
    while borrower.ask("stats", "stats")["reads"] <= reads:
        assert time.monotonic() < deadline, "the borrower never read its blocks again"
    donor.status_until(lambda st: st["lent"] == 8 and not st["peers"][0]["suspect"])
    assert borrower.ask("stats", "stats")["read_violations"] == 0
    for proc in (donor, borrower):
        assert proc.ask("integrity", "integrity")["ok"] and not proc.violations()


def test_a_stopped_donor_keeps_its_borrowers_lease(sims):
    """SIGSTOP a donor for three heartbeat timeouts: the borrower suspects it, keeps its lease
    (still readable: its read deadline is far off), and both carry on after SIGCONT."""
    donor = sims.start("donor", "--donate", "32")
    borrower = sims.start("borrower")
    grant = _borrow(donor, borrower, 8)
    _pause(
        donor,
        PAUSE,
        borrower,
        lambda st: [q["suspect"] for q in st["peers"]] == [True] and len(st["leases"]) == 1,
    )
    borrower.status_until(lambda st: not st["peers"][0]["suspect"])
    assert not _lost_events(borrower) and not _lost_events(donor)
    st = donor.status_until(lambda st: not st["peers"][0]["suspect"])
    assert st["lent"] == 8 and st["leases"][0]["lease_id"] == grant["key"][2]


def test_a_donor_killed_while_stopped_is_detected_within_the_timeout(sims):
    """A stopped donor is kept; once killed, its borrower sees the process gone within the
    heartbeat timeout, drops the lease, and removes the donor's socket and record."""
    donor = sims.start("donor", "--donate", "32", "--block-bytes", "1024")
    borrower = sims.start("borrower", "--readers", "1")
    grant = _borrow(donor, borrower, 8)
    socket_path = donor.ready["endpoint"][len("ipc://") :]
    record = os.path.join(sims.rdv, "donor.peer")
    assert os.path.exists(socket_path) and os.path.exists(record)
    pauses = _pauses(borrower)
    os.kill(donor.proc.pid, signal.SIGSTOP)
    time.sleep(2 * TIMEOUT)  # stopped, not dead: nothing may happen yet
    assert not _lost_events(borrower)
    killed_at = time.monotonic()
    donor.kill()
    lost = borrower.wait_for(_ev("LeaseLost"), TIMEOUT + SLACK + 5)
    assert lost["key"] == grant["key"] and lost["reason"] == "heartbeat timeout"
    # when the borrower's agent declared the donor dead (not when its event pump printed it)
    gone = borrower.wait_for(_ev("PeerChanged", agent_id="donor", joined=False), 5)
    assert gone["reason"] == "heartbeat timeout"
    assert gone["at"] - killed_at <= _detection_bound(borrower, pauses), (gone, lost)
    borrower.status_until(lambda st: st["counters"].get("swept", 0) >= 2)
    assert not os.path.exists(socket_path) and not os.path.exists(record)
    assert borrower.ask("stats", "stats")["read_violations"] == 0


def test_a_borrower_killed_while_stopped_is_detected_and_its_blocks_return(sims):
    """A stopped borrower is kept; once killed, its donor sees the process gone within the
    heartbeat timeout and gets every lent block back, reusable at once."""
    donor = sims.start("donor", "--donate", "32")
    borrower = sims.start("borrower")
    _borrow(donor, borrower, 20)
    donor.status_until(lambda st: st["lent"] == 20)
    pauses = _pauses(donor)
    os.kill(borrower.proc.pid, signal.SIGSTOP)
    time.sleep(2 * TIMEOUT)  # stopped, not dead: the lease stands
    assert donor.status()["lent"] == 20
    killed_at = time.monotonic()
    borrower.kill()
    gone = donor.wait_for(_ev("PeerChanged", agent_id="borrower", joined=False), TIMEOUT + 5)
    assert gone["reason"] == "heartbeat timeout"
    assert gone["at"] - killed_at <= _detection_bound(donor, pauses), gone
    assert donor.status()["lent"] == 0
    donor.send("demand", n=32)
    assert len(donor.wait_for(_ev("BlocksReturned"), 5)["blocks"]) == 32
