"""`ControlAgent.on_reclaim`: a borrower acknowledges a reclaim from the agent's I/O thread, so
its donor never waits for the owner's loop (a scheduler in a long forward pass).

Invariants: the handler runs on the I/O thread as the reclaim arrives, outside the agent's lock
(it may wait on threads that call the agent), before the event reaches `poll_events`; an ack it
makes reaches the donor with the owner never polling; a failing handler does not ack, is counted,
and the owner still gets the event to handle."""

from __future__ import annotations

import threading

import pytest
from unit.control_helpers import MEM, next_event, short_rendezvous

from sglang_swift.control import (
    BlocksReturned,
    ControlAgent,
    ControlConfig,
    LeaseGranted,
    ReclaimRequested,
)


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


def test_each_reclaims_ack_leaves_before_the_next_handler_runs(tmp_path):
    """Two reclaims delivered in one I/O step: the first's ack is sent as soon as its handler
    returns, not after the second handler (a donor reclaiming two leases waits for the slower
    fence only on that lease); what a handler defers (its logging) runs after both acks."""
    agent = ControlAgent(_cfg(str(tmp_path), "borrower"))  # not started: no I/O thread
    order = []
    agent.borrower.ack = lambda key, rid: order.append(("ack", rid))

    def handler(ev: ReclaimRequested) -> None:
        order.append(("handler", ev.reclaim_id))
        agent.ack_reclaim(ev)
        agent.defer(order.append, ("log", ev.reclaim_id))

    agent.on_reclaim(handler)
    key = ("donor", 1, 7)
    for rid in (1, 2):
        agent._reclaims.append(ReclaimRequested(key, rid, (rid,), 0.0))
    agent._deliver_reclaims()
    agent._drain_commands()
    agent._run_deferred()
    assert order == [("handler", 1), ("ack", 1), ("handler", 2), ("ack", 2), ("log", 1),
                     ("log", 2)]
    assert [e.reclaim_id for e in agent.poll_events()] == [1, 2]  # the owner still gets both


def test_a_handlers_deferred_work_runs_after_its_ack_was_sent(pair):
    """A live agent: the ReclaimAck the handler queued is on the wire before the work the
    handler deferred (the runtime's log line) runs, and a deferred failure is only logged."""
    donor, borrower = pair
    order = []
    send = borrower.link.send

    def recording_send(endpoint, env):
        order.append(type(env.body).__name__)
        return send(endpoint, env)

    borrower.link.send = recording_send

    def handler(ev: ReclaimRequested) -> None:
        borrower.ack_reclaim(ev)
        borrower.defer(lambda: 1 / 0)  # logged, not fatal
        borrower.defer(order.append, "deferred")

    borrower.on_reclaim(handler)
    donor.demand(4)
    assert len(next_event(donor, BlocksReturned).blocks) == 4
    assert borrower.wait_until(lambda a: "deferred" in order, 5)
    assert "ReclaimAck" in order[:order.index("deferred")]
    assert borrower.is_alive()
    next_event(borrower, ReclaimRequested)


def test_no_garbage_collection_runs_between_a_reclaim_and_its_ack(tmp_path):
    """A collection that comes due while the handler fences (its allocations cross the
    threshold) waits until the ack was sent: the donor's wait never holds one (a full collection
    walks every object not frozen: tens of ms after traffic). It runs right after instead, and
    the collector is left enabled."""
    import gc

    agent = ControlAgent(_cfg(str(tmp_path), "borrower"))
    window = [False]
    during, after = [], []

    def on_gc(phase, info):
        if phase == "start":
            (during if window[0] else after).append(info["generation"])

    def ack(key, rid):
        window[0] = False  # the ack is on its way: the donor waits no longer

    def handler(ev: ReclaimRequested) -> None:
        window[0] = True
        kept = [[i] for i in range(5000)]  # the fence's allocations, far past the threshold
        agent.ack_reclaim(ev)
        assert len(kept) == 5000

    agent.borrower.ack = ack
    agent.on_reclaim(handler)
    agent._reclaims.append(ReclaimRequested(("donor", 1, 7), 1, (1,), 0.0))
    thresholds = gc.get_threshold()
    gc.set_threshold(100, 10, 10)
    gc.callbacks.append(on_gc)
    try:
        agent._deliver_reclaims()
        assert not window[0] and gc.isenabled()
        junk = [[i] for i in range(1000)]  # the next allocations after: the due one runs
        del junk
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*thresholds)
    assert during == []
    assert after, "no collection ran after the ack"
