"""Liveness of the control channel: silence alone never costs a lease; a passed read deadline
leads to re-validation with the donor; death is declared on evidence (process gone, socket
closed) or after the long unresponsive timeout. Two agents in one process (real ipc sockets,
background threads); an agent's I/O thread is frozen by holding its lock."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import zmq
from unit.control_helpers import MEM, next_event, short_rendezvous

from sglang_swift.common.process import host_identity, process_start_time
from sglang_swift.control import (
    ControlAgent,
    ControlConfig,
    ControlConfigError,
    LeaseGranted,
    LeaseLost,
    PeerChanged,
)
from sglang_swift.control import protocol as p
from sglang_swift.control.auth import load_or_create_secret
from sglang_swift.control.liveness import Liveness
from sglang_swift.control.peers import Peer


def _cfg(rdv: str, agent_id: str, **kw) -> ControlConfig:
    base = dict(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.3)
    return ControlConfig(agent_id, rendezvous_dir=rdv, **{**base, **kw})




@pytest.fixture
def rdv():
    with short_rendezvous("swcl") as path:
        yield path


def _pair(rdv: str, **kw) -> tuple[ControlAgent, ControlAgent]:
    donor = ControlAgent(_cfg(rdv, "donor", **kw), memory=MEM).start()
    borrower = ControlAgent(_cfg(rdv, "borrower", **kw)).start()
    donor.offer(range(32))
    assert borrower.wait_until(lambda a: "donor" in a.peers and a.peers["donor"].lendable, 5)
    return donor, borrower


def test_a_frozen_borrower_past_its_read_deadline_revalidates_and_keeps_its_lease(rdv):
    """Freeze the borrower's agent longer than the heartbeat timeout and its read validity but
    shorter than the unresponsive timeout: it stops reading at its deadline, the donor keeps
    the lease, and after the pause a re-validation re-arms the same lease and blocks."""
    donor, borrower = _pair(rdv, unresponsive_timeout_s=3.0, lease_margin_s=2.0)  # validity 1 s
    try:
        borrower.request(6)
        grant = next_event(borrower, LeaseGranted)
        with borrower._lock:  # the borrower's I/O thread stops at its next message
            time.sleep(1.6)  # the pause under test: > validity (1 s) and > timeout (0.3 s)
            assert borrower.borrower.read_deadline("donor") < time.monotonic()
            assert donor.status().lent == 6 and "borrower" in donor.peers
            assert donor.status().peers[0].suspect
        assert borrower.wait_until(
            lambda a: a.borrower.read_deadline("donor") > time.monotonic(), 5
        ), "the lease was never re-validated"
        held = borrower.borrower.leases[grant.key]
        assert held.blocks() == set(grant.blocks)
        assert borrower.counters.get("leases_revalidated") == 1
        assert donor.counters.get("revalidations_answered", 0) >= 1
        assert donor.counters.get("suspicions", 0) >= 1
        assert not [e for e in borrower.poll_events() if isinstance(e, LeaseLost)]
        assert not [e for e in donor.poll_events() if isinstance(e, PeerChanged) and not e.joined]
        assert donor.status().lent == 6
        assert not donor.status().peers[0].suspect
        borrower.check_integrity()
    finally:
        borrower.stop()
        donor.stop()


def test_a_borrower_frozen_past_the_unresponsive_timeout_stops_reading_first(rdv):
    """The borrower's read deadline ends before its donor declares it dead (unresponsive);
    after the pause the re-validation is refused, the lease is lost, and it borrows again."""
    donor, borrower = _pair(rdv, unresponsive_timeout_s=1.2, lease_margin_s=0.4)
    try:
        borrower.request(6)
        grant = next_event(borrower, LeaseGranted)
        with borrower._lock:
            deadline = borrower.read_deadline("donor")
            gone = next_event(donor, PeerChanged, joined=False)
        assert gone.reason == "unresponsive"
        assert deadline < gone.at, "the donor could reuse blocks the borrower may still read"
        lost = next_event(borrower, LeaseLost)
        assert lost.key == grant.key and lost.reason in ("dropped by the donor", "donor forgot us")
        assert borrower.wait_until(lambda a: "donor" in a.peers and a.peers["donor"].lendable, 5)
        assert donor.wait_until(lambda a: "borrower" in a.peers, 5)
        borrower.request(32)
        assert len(next_event(borrower, LeaseGranted).blocks) == 32
    finally:
        borrower.stop()
        donor.stop()


def test_a_frozen_donor_does_not_cost_the_borrower_its_lease(rdv):
    """A donor whose agent does not run for several heartbeat timeouts is suspected, not
    declared dead: the borrower's lease and read deadline survive the pause."""
    donor, borrower = _pair(rdv)
    try:
        borrower.request(4)
        grant = next_event(borrower, LeaseGranted)
        with donor._lock:
            time.sleep(1.2)
            assert borrower.status().peers[0].suspect
            assert borrower.read_deadline("donor") > time.monotonic()
        assert borrower.wait_until(lambda a: not a.status().peers[0].suspect, 5)
        assert [s.lease_id for s in borrower.status().leases] == [grant.key.lease_id]
        events = borrower.poll_events()
        assert not [e for e in events if isinstance(e, LeaseLost)]
        assert not [e for e in events if isinstance(e, PeerChanged) and not e.joined]
        assert borrower.counters["max_silence_ms"] >= 1000
    finally:
        borrower.stop()
        donor.stop()


def test_a_peer_whose_socket_closed_is_declared_dead_within_the_timeout(rdv):
    """A peer we cannot check by pid (another host or namespace) is declared dead once the
    connection to its socket has been down for a heartbeat timeout, long before the
    unresponsive timeout."""
    borrower = ControlAgent(_cfg(rdv, "borrower")).start()
    ctx = zmq.Context.instance()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{os.path.dirname(rdv)}/far.sock"
    router.bind(endpoint)
    try:
        codec = p.Codec(load_or_create_secret(os.path.join(rdv, "secret")))
        hello = p.Hello(p.PROTOCOL_VERSION, "m", endpoint, 1, 256, 8, "cpu", host="elsewhere")
        dealer.connect(borrower.endpoint)
        dealer.send(codec.encode(p.Envelope("far", 1, 0, 1, hello)))
        assert borrower.wait_until(lambda a: "far" in a.peers, 5)
        assert router.poll(5000)  # the borrower connected and talks to it
        router.close()
        closed_at = time.monotonic()
        gone = next_event(borrower, PeerChanged, joined=False)
        assert gone.reason == "connection closed"
        assert gone.at - closed_at < 0.3 * 2 + 0.5 < borrower.config.dead_after_s
    finally:
        router.close()
        dealer.close()
        borrower.stop()


def _liveness(timeout: float = 1.0) -> tuple[Liveness, SimpleNamespace]:
    agent = SimpleNamespace(
        config=ControlConfig("me", heartbeat_interval_s=0.1, heartbeat_timeout_s=timeout),
        counters={},
        peers={},
        link=SimpleNamespace(closed_for=lambda endpoint, now: 0.0),
    )
    agent.count = lambda name, n=1: agent.counters.__setitem__(
        name, agent.counters.get(name, 0) + n
    )
    return Liveness(agent), agent


def _peer(pid: int, host: str, pid_start: int = 0, last_rx: float = 0.0) -> Peer:
    hello = p.Hello(p.PROTOCOL_VERSION, "m", "ipc:///x", pid)
    return Peer("q", 1, "ipc:///x", pid, "m", hello, last_rx, host=host, pid_start=pid_start)


def test_a_gone_process_on_this_host_is_dead_at_the_timeout_and_only_then():
    """Same host: a silent peer whose pid is free (or reused by a later process) is dead
    once suspected; a live one, or one on another host, stays until the long timeout."""
    live, _ = _liveness()
    here = host_identity()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid is free
    me = os.getpid()
    assert live.verdict(_peer(child.pid, here), 0.5) == ""  # not yet silent long enough
    assert live.verdict(_peer(child.pid, here), 1.5) == "heartbeat timeout"
    assert live.verdict(_peer(me, here, process_start_time(me)), 1.5) == ""
    assert live.verdict(_peer(me, here, process_start_time(me) + 1), 1.5) == "heartbeat timeout"
    assert live.verdict(_peer(child.pid, "another-host"), 1.5) == ""
    assert live.verdict(_peer(me, here), 21.0) == "unresponsive"


def test_own_pause_is_not_counted_against_peers():
    """After a tick gap longer than the heartbeat timeout, each peer's silence is shifted by
    the gap, so a peer is never declared dead for our own pause."""
    live, agent = _liveness()
    agent.peers["q"] = peer = _peer(os.getpid(), "", last_rx=100.0)
    live.own_pause(100.5)
    live.own_pause(125.5)  # we did not run for 25 s
    assert peer.last_rx == 125.0
    assert live.verdict(peer, 125.6) == ""
    assert agent.counters["own_pauses"] == 1 and agent.counters["max_own_pause_ms"] == 25000


def test_liveness_settings_are_checked_with_the_fix_in_the_message():
    """The derived unresponsive timeout covers slow heartbeats; impossible orders are refused."""
    cfg = ControlConfig("a", heartbeat_timeout_s=3.0)
    assert cfg.dead_after_s == 30.0 and cfg.read_validity_s == 30.0 - cfg.lease_margin_s
    assert ControlConfig("a").dead_after_s == 20.0
    with pytest.raises(ControlConfigError, match="unresponsive_timeout_s"):
        ControlConfig("a", heartbeat_timeout_s=2.0, unresponsive_timeout_s=1.5)
    with pytest.raises(ControlConfigError, match="lease_margin_s"):
        ControlConfig("a", unresponsive_timeout_s=2.0, lease_margin_s=1.5)
