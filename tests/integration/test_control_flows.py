"""Lease flows between real agent processes over ipc: grant, reclaim, the reclaim-before-ack
ordering under concurrent reads, and rejection of a peer without the node secret."""

from __future__ import annotations

import pytest
from integration.conftest import event as _ev

pytestmark = pytest.mark.integration


def _lendable(borrower, donor_id: str, timeout: float = 10.0) -> None:
    borrower.status_until(
        lambda st: any(q["agent_id"] == donor_id and q["lendable"] for q in st["peers"]), timeout
    )


def _integrity(*procs) -> None:
    for proc in procs:
        assert proc.ask("integrity", "integrity")["ok"], proc.agent_id
        assert not proc.violations(), proc.violations()


def test_grant_and_reclaim_between_processes(sims):
    """A borrower gets what it asks for; the donor's demand takes free blocks, then reclaims."""
    donor = sims.start("donor", "--donate", "64")
    borrower = sims.start("borrower", "--auto-ack")
    _lendable(borrower, "donor")
    borrower.send("request", n=48, donor="donor")
    grant = borrower.wait_for(_ev("LeaseGranted"), 10)
    assert len(grant["blocks"]) == 48 and grant["key"][1] == donor.epoch
    donor.send("demand", n=40)
    back = set()
    start = 0
    while len(back) < 40:
        e = donor.wait_for(_ev("BlocksReturned"), 10, start)
        start = donor.events.index(e) + 1
        back |= set(e["blocks"])
    assert len(back) == 40
    rec = borrower.wait_for(_ev("ReclaimRequested"), 10)
    assert len(rec["blocks"]) == 24 and set(rec["blocks"]) <= back
    _integrity(donor, borrower)


def test_reclaimed_blocks_wait_for_the_ack_past_the_deadline(sims):
    """The donor re-sends an unacknowledged reclaim after its deadline but never reuses the
    blocks until the borrower acknowledges."""
    donor = sims.start("donor", "--donate", "16", "--reclaim-deadline", "0.2")
    borrower = sims.start("borrower")
    _lendable(borrower, "donor")
    borrower.send("request", n=16, donor="donor")
    borrower.wait_for(_ev("LeaseGranted"), 10)
    donor.send("demand", n=4)
    borrower.wait_for(_ev("ReclaimRequested"), 10)
    donor.status_until(lambda st: st["counters"].get("reclaims_resent", 0) >= 1)
    assert not [e for e in donor.events if e["ev"] == "BlocksReturned"]
    borrower.send("ack_pending")
    assert len(donor.wait_for(_ev("BlocksReturned"), 10)["blocks"]) == 4
    _integrity(donor, borrower)


def _reclaim_cycles(donor, borrower, rounds: int) -> None:
    """Each round: the borrower holds all 64 blocks, then the donor takes 1-16 back."""
    _lendable(borrower, "donor")
    for i in range(rounds):
        for _ in range(20):  # grants may be partial while returned blocks are re-offered
            st = donor.status_until(lambda st: st["lendable"] + st["lent"] == 64)
            if st["lent"] == 64:
                break
            borrower.send("request", n=64 - st["lent"], donor="donor")
            try:
                donor.status_until(lambda st: st["lent"] == 64, 1.0)
                break
            except TimeoutError:
                continue
        else:
            raise TimeoutError("the borrower never held the whole arena")
        start = len(donor.events)
        donor.send("demand", n=1 + (i * 7) % 16)
        donor.wait_for(_ev("BlocksReturned"), 10, start)  # scribbled, then lent again


def test_readers_never_see_a_reused_block(sims):
    """Two reader threads read leased blocks nonstop while reclaims arrive; the donor
    overwrites every block it gets back. No read ever sees the overwrite."""
    donor = sims.start(
        "donor", "--donate", "64", "--block-bytes", "4096", "--scribble", "--reoffer"
    )
    borrower = sims.start("borrower", "--readers", "2")
    _reclaim_cycles(donor, borrower, 30)
    stats = borrower.ask("stats", "stats")
    assert stats["reads"] > 1000 and stats["read_violations"] == 0, stats
    assert stats["acks"] >= 30
    _integrity(donor, borrower)


def test_negative_control_early_ack_is_caught(sims):
    """The harness is sharp: a borrower that acks before its readers stop is caught."""
    donor = sims.start(
        "donor", "--donate", "64", "--block-bytes", "4096", "--scribble", "--reoffer"
    )
    borrower = sims.start("borrower", "--readers", "2", "--unsafe-ack-early")
    _reclaim_cycles(donor, borrower, 10)
    assert borrower.ask("stats", "stats")["read_violations"] > 0


def test_peer_without_the_secret_is_rejected_and_logged(sims):
    """An agent holding another secret finds the rendezvous but can never join or borrow."""
    donor = sims.start("donor", "--donate", "16", "--log-level", "INFO")
    intruder = sims.start("intruder", "--secret-file", f"{sims.root}/other-secret")
    friend = sims.start("friend")
    _lendable(friend, "donor")
    donor.status_until(lambda st: st["counters"].get("bad_auth", 0) >= 1)
    intruder.send("request", n=4, donor="donor")
    failed = intruder.wait_for(_ev("RequestFailed"), 10)
    assert failed["reason"] == "no_donor"
    assert {q["agent_id"] for q in donor.status()["peers"]} == {"friend"}
    assert "HMAC mismatch" in sims.log(donor)
    _integrity(donor, friend)
