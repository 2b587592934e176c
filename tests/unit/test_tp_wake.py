"""Waking an idle TP server's scheduler loop for a reclaim (`integration/loop_wake.py`).

A TP borrower acknowledges a reclaim only at its scheduler's pump, after every rank fenced the
pages; an idle SGLang scheduler started with `--sleep-on-idle` sleeps in its idle sleeper's zmq
poll (up to a second, rank 0 only: the other ranks wait on rank 0's broadcast). Invariants:
- the agent's I/O thread wakes rank 0's poll after it queued an event that waits for the pump
  (`runtime.WAKE_EVENTS`), never before (the woken loop's poll of the agent finds the event);
- the step drains the wake (the poll sleeps again: no busy loop), and a drained wake makes the
  pump due (`SwiftRuntime.woken`), also with no sleeper (a spinning loop pumps at its next turn);
- an idle TP borrower asleep in SGLang's real `IdleSleeper` acknowledges a reclaim within a
  loop, not when its poll times out: the donor's pages come back in well under the second.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper
from unit.test_runtime import DONOR_SHAPE
from unit.test_tp_runtime import (
    RANK_SHAPE,
    _config,
    _leased,
    _on_ranks,
    _pool,
    _pump_until,
    _runtime,
    _tp_borrower,
)

from sglang_swift.control import (
    BlocksReturned,
    ControlAgent,
    ControlConfig,
    LeaseGranted,
    LeaseKey,
    ReclaimRequested,
)
from sglang_swift.integration.loop_wake import LoopWake
from sglang_swift.integration.runtime import STEP_INTERVAL_S, WAKE_EVENTS

SLEEP_S = 1.0  # IdleSleeper.maybe_sleep's poll


def _sleeper_of(wake: LoopWake) -> IdleSleeper:
    """SGLang's own idle sleeper (no sockets of SGLang's here) with the wake registered."""
    sleeper = IdleSleeper([])
    assert wake.watch(SimpleNamespace(idle_sleeper=sleeper)) == \
        "registered on the idle sleeper's poller"
    return sleeper


def test_a_wake_returns_the_poll_once_and_the_drain_empties_it():
    wake = LoopWake()
    sleeper = _sleeper_of(wake)
    try:
        assert sleeper.poller.poll(0) == [] and not wake.drain()
        for _ in range(3):  # three events before the loop ran: one drain takes them all
            wake.wake()
        assert sleeper.poller.poll(0) == [(wake.fileno(), 1)]
        assert wake.drain()
        assert sleeper.poller.poll(0) == [], "a drained wake would spin the idle poll"
        assert not wake.drain()

        # an asleep loop returns as the wake comes, not at the poll's timeout
        threading.Timer(0.05, wake.wake).start()
        t0 = time.monotonic()
        sleeper.maybe_sleep()
        assert time.monotonic() - t0 < SLEEP_S / 2
        assert wake.drain() and sleeper.poller.poll(0) == []
    finally:
        wake.close()
    assert sleeper.poller.sockets == []  # it leaves SGLang's poller when closed
    wake.wake()  # after close: nothing written anywhere
    assert not wake.drain()


def test_a_scheduler_without_a_zmq_sleeper_gets_nothing_registered_and_still_a_wake():
    """Without --sleep-on-idle the loop spins: nothing to register, and a wake still makes
    the next step's pump due. A sleeper without a zmq poller (SGLang's Rust ingress) is left
    alone, with the reason."""
    wake = LoopWake()
    try:
        assert "does not sleep" in wake.watch(SimpleNamespace(idle_sleeper=None))
        assert "no zmq poller" in wake.watch(SimpleNamespace(idle_sleeper=object()))
        wake.wake()
        assert wake.drain() and not wake.drain()
    finally:
        wake.close()


def test_the_agent_tells_on_queued_after_the_event_is_queued(tmp_path):
    """`on_queued` runs after the event is in the owner's queue (a woken loop's poll finds
    it), for a reclaim after its `on_reclaim` handler; a failing one is counted and the event
    stays queued."""
    agent = ControlAgent(ControlConfig("borrower", rendezvous_dir=str(tmp_path)))  # no thread
    seen = []
    agent.on_queued(lambda ev: seen.append((type(ev).__name__, agent._events.qsize())))
    agent.on_reclaim(lambda ev: seen.append(("handler", agent._events.qsize())))
    key = LeaseKey("donor", 1, 7)
    agent.emit(BlocksReturned((1, 2)))
    agent.emit(ReclaimRequested(key, 1, (3,), 0.0))
    assert seen == [("BlocksReturned", 1)]  # the reclaim waits for its handler (I/O step)
    agent._deliver_reclaims()
    assert seen == [("BlocksReturned", 1), ("handler", 1), ("ReclaimRequested", 2)]

    def boom(ev):
        raise RuntimeError("owner bug")
    agent.on_queued(boom)
    agent.emit(BlocksReturned((4,)))
    assert agent.counters["queued_handler_errors"] == 1
    assert [type(e) for e in agent.poll_events()] == [BlocksReturned, ReclaimRequested,
                                                      BlocksReturned]


def test_only_the_events_that_wait_for_the_pump_wake_the_loop():
    assert set(WAKE_EVENTS) == {ReclaimRequested, BlocksReturned}
    assert LeaseGranted not in WAKE_EVENTS  # taken at the next loop: nobody waits for it


@pytest.fixture
def idle_pair(tmp_path, monkeypatch):
    config = _config(tmp_path, role="donor", lend_fraction=0.5)
    donor = _runtime(config, "donor", _pool(monkeypatch, config, DONOR_SHAPE))
    ranks = _tp_borrower(tmp_path, monkeypatch, [RANK_SHAPE, RANK_SHAPE])
    donor.start()
    for rt in ranks:
        rt.start()
    try:
        yield donor, ranks
    finally:
        for rt in ranks:
            rt.stop()
        donor.stop()


def test_an_idle_tp_borrower_acknowledges_a_reclaim_within_a_loop(idle_pair):
    """The borrower's ranks run SGLang's idle loop: rank 0 sleeps in a real IdleSleeper, the
    other rank waits on rank 0's collectives, and a pump is due as `swift_step` decides (woken,
    or STEP_INTERVAL_S since the last loop). The donor's reclaim comes 50 ms into a sleep: its
    pages are back long before the poll's second is over (without the wake they come back
    when it ends), and the loop then sleeps again until woken (no spin)."""
    donor, ranks = idle_pair
    assert ranks[0].wake is not None and ranks[1].wake is None  # rank 0's agent wakes rank 0
    _pump_until(donor, ranks, _leased(ranks))
    leased = len(ranks[0].borrowing.leases[next(iter(ranks[0].borrowing.leases))].pages)
    assert leased and donor.lent_tokens >= leased
    sleeper = IdleSleeper([])
    ranks[0].watch_loop(SimpleNamespace(idle_sleeper=sleeper))
    asleep, stop = threading.Event(), threading.Event()
    loops: list[tuple[float, bool]] = []  # rank 0: (when its sleep ended, woken)

    def idle_loop(r):
        rt = ranks[r]
        while True:
            if r == 0:
                asleep.set()
                sleeper.maybe_sleep()
                asleep.clear()
                woken = rt.woken()  # then runtime.ControlStep's rule
                now = time.monotonic()
                loops.append((now, woken))
                rt.pump(due=woken or now - (loops[-2][0] if len(loops) > 1 else 0.0)
                        >= STEP_INTERVAL_S)
            else:
                rt.pump(due=False)  # rank 0's due decides
            if rt.tp.share(stop.is_set() if r == 0 else None):
                return

    failed: list = []

    def run_ranks():
        try:
            _on_ranks(idle_loop, 2)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    borrower = threading.Thread(target=run_ranks)
    borrower.start()
    try:
        donor.pump()  # the pages offered but not leased come back at once
        assert asleep.wait(5)
        time.sleep(0.05)
        own = donor.allocator.alloc(donor.allocator.available_size())  # its own traffic
        assert own is not None
        t0 = time.monotonic()
        while donor.lent_tokens and time.monotonic() - t0 < 5:
            donor.pump()
            donor.lend()
            time.sleep(0.002)
        back_s = time.monotonic() - t0
        assert donor.lent_tokens == 0
        time.sleep(0.3)  # the borrower's loop: asleep again, not spinning
        quiet = [t for t, _ in loops if t > t0 + back_s]
    finally:
        stop.set()
        if ranks[0].wake is not None:
            ranks[0].wake.wake()  # end the last sleep now
        borrower.join(30)
    assert not failed and not borrower.is_alive(), failed
    assert back_s < SLEEP_S / 2, f"the donor waited {back_s * 1e3:.0f} ms for its pages"
    assert any(woken for _, woken in loops), "the reclaim's pump was due through the wake"
    assert quiet == [], f"{len(quiet)} loops ran after the ack with nothing to do"
    for rt in ranks:
        assert rt.stats["reclaims"] > 0 and rt.tree.donor.capacity_tokens() == 0
        rt.tree.check_integrity()
