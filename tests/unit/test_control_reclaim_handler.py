"""`ControlAgent.on_reclaim`: a borrower acknowledges a reclaim from the agent's I/O thread, so
its donor never waits for the owner's loop (a scheduler in a long forward pass).

Invariants: the handler runs on the I/O thread as the reclaim arrives, outside the agent's lock
(it may wait on threads that call the agent), before the event reaches `poll_events`; an ack it
makes reaches the donor with the owner never polling; a failing handler does not ack, is counted,
and the owner still gets the event to handle."""

from __future__ import annotations

import threading

import pytest

from sglang_swift.control import (BlocksReturned, ControlAgent, ControlConfig, LeaseGranted,
                                  ReclaimRequested)
from unit.control_helpers import MEM, next_event, short_rendezvous


def _cfg(rdv: str, agent_id: str) -> ControlConfig:
    return ControlConfig(agent_id, rendezvous_dir=rdv, heartbeat_interval_s=0.05,
                         heartbeat_timeout_s=0.6, lease_margin_s=0.15, request_timeout_s=2.0)


@pytest.fixture
def pair():
    with short_rendezvous("swrh") as rdv:
        donor = ControlAgent(_cfg(rdv, "donor"), memory=MEM).start()
        borrower = ControlAgent(_cfg(rdv, "borrower")).start()
        donor.offer(range(32))
        try:
            assert borrower.wait_until(lambda a: "donor" in a.peers
                                       and a.peers["donor"].lendable, 5)
            borrower.request(32)
            next_event(borrower, LeaseGranted)
            yield donor, borrower
        finally:
            borrower.stop()
            donor.stop()


def test_the_handler_acks_on_the_io_thread_without_the_owner_polling(pair):
    """The donor gets its blocks back while the borrower's owner never polls or acks; the
    handler ran on the agent's thread, outside its lock (a thread it waits for can read a
    deadline), and before the event was queued; the owner gets the event afterwards."""
    donor, borrower = pair
    seen = []

    def handler(ev: ReclaimRequested) -> None:
        # a copy thread that asks the agent for a read deadline while the handler waits for it:
        # deadlocks (and times out) if the handler were called under the agent's lock
        asker = threading.Thread(target=lambda: borrower.read_deadline("donor"))
        asker.start()
        asker.join(5)
        seen.append((threading.current_thread().name, asker.is_alive(),
                     len(borrower.poll_events())))
        borrower.ack_reclaim(ev)

    borrower.on_reclaim(handler)
    donor.demand(5)
    back = next_event(donor, BlocksReturned)
    assert len(back.blocks) == 5
    assert seen == [("swift-ctl-borrower", False, 0)]
    rec = next_event(borrower, ReclaimRequested)  # still handed to the owner, after the handler
    assert sorted(rec.blocks) == sorted(back.blocks)
    borrower.ack_reclaim(rec)  # a second ack is ignored
    borrower.on_reclaim(None)
    donor.demand(3)
    late = next_event(borrower, ReclaimRequested)  # unregistered: the owner's path again
    assert not [e for e in donor.poll_events() if isinstance(e, BlocksReturned)]
    borrower.ack_reclaim(late)
    assert len(next_event(donor, BlocksReturned).blocks) == 3
    donor.check_integrity()
    borrower.check_integrity()


def test_a_failing_handler_leaves_the_reclaim_to_the_owner(pair):
    """A handler that raises does not ack: the blocks stay with the borrower until the owner,
    which still gets the event, acknowledges."""
    donor, borrower = pair

    def handler(ev: ReclaimRequested) -> None:
        raise RuntimeError("owner bug")

    borrower.on_reclaim(handler)
    donor.demand(4)
    rec = next_event(borrower, ReclaimRequested)
    assert borrower.counters.get("reclaim_handler_errors") == 1
    assert donor.status().leases[0].reclaiming == 4
    assert not [e for e in donor.poll_events() if isinstance(e, BlocksReturned)]
    borrower.ack_reclaim(rec)
    assert len(next_event(donor, BlocksReturned).blocks) == 4
