"""Two agents in one process (real ipc sockets, background threads): the lease life cycle,
stale and forged input, timeouts, and the `ctl status` view."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import zmq
from unit.control_helpers import MEM, next_event, short_rendezvous

from sglang_swift import ctl
from sglang_swift.common.process import host_identity, host_tag
from sglang_swift.control import (
    BlocksReturned,
    ControlAgent,
    ControlConfig,
    LeaseGranted,
    PeerChanged,
    ReclaimRequested,
    RequestFailed,
    discovery,
)
from sglang_swift.control import protocol as p
from sglang_swift.control.auth import load_or_create_secret


def _cfg(rdv: str, agent_id: str, **kw) -> ControlConfig:
    return ControlConfig(
        agent_id,
        rendezvous_dir=rdv,
        heartbeat_interval_s=0.05,
        heartbeat_timeout_s=0.6,
        lease_margin_s=0.15,
        **kw,
    )




@pytest.fixture
def rdv():
    """A short rendezvous path (ipc socket paths are limited to 107 bytes), removed after."""
    with short_rendezvous("swcu") as path:
        yield path


@pytest.fixture
def pair(rdv):
    donor = ControlAgent(_cfg(rdv, "donor", request_timeout_s=0.5), memory=MEM).start()
    borrower = ControlAgent(_cfg(rdv, "borrower", request_timeout_s=0.5)).start()
    donor.offer(range(32))
    try:
        assert borrower.wait_until(lambda a: "donor" in a.peers and a.peers["donor"].lendable, 5)
        yield rdv, donor, borrower
    finally:
        borrower.stop()
        donor.stop()


def test_grant_reclaim_ack_cycle(pair):
    """Reclaimed blocks come back to the donor's owner only after the borrower's ack."""
    _, donor, borrower = pair
    borrower.request(32)
    grant = next_event(borrower, LeaseGranted)
    assert len(grant.blocks) == 32 and grant.memory.owner_uuid == f"donor:{donor.epoch}"
    donor.demand(5)
    rec = next_event(borrower, ReclaimRequested)
    assert len(rec.blocks) == 5 and rec.deadline > time.monotonic() - 1
    assert not [e for e in donor.poll_events() if isinstance(e, BlocksReturned)]
    assert donor.status().leases[0].reclaiming == 5
    borrower.ack_reclaim(rec)
    back = next_event(donor, BlocksReturned)
    assert sorted(back.blocks) == sorted(rec.blocks)
    borrower.release(grant.key)
    assert donor.wait_until(lambda a: a.status().lent == 0, 5)
    donor.check_integrity()
    borrower.check_integrity()


def test_owner_mistakes_fail_loudly_or_are_refused(pair):
    """Impossible requests raise at the call; bad donor commands are refused, not fatal."""
    _, donor, borrower = pair
    with pytest.raises(ValueError):
        borrower.request(0)
    with pytest.raises(ValueError):
        borrower.request(1, priority=1000)
    donor.offer([0])  # already offered
    donor.offer([10**6])  # outside the arena
    assert donor.wait_until(lambda a: a.counters.get("commands_refused", 0) == 2, 5)
    assert donor.is_alive()
    borrower.request(2)
    assert len(next_event(borrower, LeaseGranted).blocks) == 2


def test_read_deadline_follows_heartbeats(pair):
    """While the donor answers, the borrower's read deadline moves forward with its heartbeats
    and stays within one read validity of now; with no lease held there is none."""
    _, donor, borrower = pair
    assert borrower.read_deadline("donor") == 0.0
    borrower.request(1)
    grant = next_event(borrower, LeaseGranted)
    validity = borrower.config.read_validity_s
    first = borrower.read_deadline("donor")
    assert time.monotonic() < first <= time.monotonic() + validity
    assert borrower.wait_until(lambda a: a.borrower.read_deadline("donor") > first + 0.2, 5)
    assert borrower.read_deadline("donor", grant.key.lease_id) <= time.monotonic() + validity
    assert borrower.read_deadline("donor", grant.key.lease_id + 1) == 0.0


def _forge(rdv: str, to: ControlAgent, env: p.Envelope) -> zmq.Socket:
    codec = p.Codec(load_or_create_secret(os.path.join(rdv, "secret")))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(to.endpoint)
    sock.send(codec.encode(env))
    return sock


def test_stale_epochs_are_harmless(pair):
    """A grant from an older donor epoch and acks for an old epoch change nothing."""
    rdv, donor, borrower = pair
    borrower.request(4)
    grant = next_event(borrower, LeaseGranted)
    donor.demand(28 + 2)
    assert len(next_event(donor, BlocksReturned).blocks) == 28  # the free ones, at once
    rec = next_event(borrower, ReclaimRequested)
    socks = [
        _forge(
            rdv,
            borrower,
            p.Envelope(
                "donor",
                donor.epoch - 1,
                borrower.epoch,
                1 << 40,
                p.Grant(99, 77, donor.epoch - 1, [9], p.MemoryDescriptor.coerce(MEM)),
            ),
        ),
        _forge(
            rdv,
            donor,
            p.Envelope(
                "borrower",
                borrower.epoch - 1,
                donor.epoch,
                1 << 40,
                p.ReclaimAck(rec.reclaim_id, grant.key.lease_id, donor.epoch, list(rec.blocks)),
            ),
        ),
        _forge(
            rdv,
            donor,
            p.Envelope(
                "borrower",
                borrower.epoch,
                donor.epoch + 1,
                1 << 40,
                p.ReclaimAck(rec.reclaim_id, grant.key.lease_id, donor.epoch, list(rec.blocks)),
            ),
        ),
    ]
    try:
        assert donor.wait_until(lambda a: a.counters.get("stale", 0) >= 2, 5)
        assert borrower.wait_until(lambda a: a.counters.get("stale", 0) >= 1, 5)
        assert donor.status().leases[0].reclaiming == 2  # still waiting for the real ack
        assert [s.lease_id for s in borrower.status().leases] == [grant.key.lease_id]
    finally:
        for s in socks:
            s.close()
    borrower.ack_reclaim(rec)
    assert len(next_event(donor, BlocksReturned).blocks) == 2


def test_unknown_sender_gets_an_error_and_no_state(pair):
    """A signed message from an agent that never said hello is answered with unknown_peer."""
    rdv, donor, _ = pair
    sock = _forge(rdv, donor, p.Envelope("ghost", 1, donor.epoch, 1, p.LeaseRequest(1, 4)))
    try:
        assert sock.poll(5000)
        reply = p.Codec(load_or_create_secret(os.path.join(rdv, "secret"))).decode(sock.recv())
        assert reply.body == p.Error(p.E_UNKNOWN_PEER, "send hello first")
        assert donor.status().lent == 0 and "ghost" not in donor.peers
    finally:
        sock.close()


def test_requests_to_a_silent_donor_time_out(rdv):
    """A donor that never answers but whose socket stays open: the request fails with
    timeout, and the peer is dropped as unresponsive after ``unresponsive_timeout_s``."""
    borrower = ControlAgent(
        _cfg(rdv, "borrower", request_timeout_s=0.3, unresponsive_timeout_s=1.5)
    ).start()
    mute = zmq.Context.instance().socket(zmq.ROUTER)
    mute.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{os.path.dirname(rdv)}/mute.sock"
    mute.bind(endpoint)
    try:
        dealer = _forge(
            rdv,
            borrower,
            p.Envelope(
                "mute",
                1,
                0,
                1,
                p.Hello(p.PROTOCOL_VERSION, "m", endpoint, os.getpid(), 256, 8, "cpu"),
            ),
        )
        assert borrower.wait_until(lambda a: "mute" in a.peers, 5)
        rid = borrower.request(2, donor="mute")
        failed = next_event(borrower, RequestFailed)
        assert (failed.request_id, failed.reason) == (rid, "timeout")
        assert borrower.wait_until(lambda a: "mute" not in a.peers, 5)
        lost = next_event(borrower, PeerChanged)
        while lost.joined:
            lost = next_event(borrower, PeerChanged)
        assert lost.reason == "unresponsive"
        dealer.close()
    finally:
        mute.close()
        borrower.stop()


def test_ctl_status_lists_agents_and_leases(pair, capsys):
    """`ctl status` shows both agents and the lease between them."""
    rdv, donor, borrower = pair
    borrower.request(3)
    next_event(borrower, LeaseGranted)
    assert ctl.main(["status", "--rendezvous-dir", rdv]) == 0
    out = capsys.readouterr().out
    assert "donor" in out and "borrower" in out and "1 lease(s)" in out
    assert ctl.main(["status", "--rendezvous-dir", rdv, "--json"]) == 0
    assert '"lent": 3' in capsys.readouterr().out


def test_ctl_sweep_removes_what_a_dead_agent_left(rdv, capsys):
    """`ctl sweep` removes the record and socket of an agent whose process is gone, and
    leaves a live agent's alone."""
    live = ControlAgent(_cfg(rdv, "live")).start()
    try:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        ghost = discovery.PeerRecord("ghost", 1, child.pid, "ipc://x", "", host_identity())
        discovery.publish(rdv, ghost)
        sock_path = os.path.join(rdv, f"dd.h{host_tag()}.p{child.pid}.sock")
        s = socket.socket(socket.AF_UNIX)
        s.bind(sock_path)
        s.close()
        assert ctl.main(["sweep", "--rendezvous-dir", rdv]) == 0
        out = capsys.readouterr().out
        assert "removed 2 name(s)" in out and "ghost.peer" in out
        assert not os.path.exists(sock_path)
        assert [r.agent_id for r in discovery.read_records(rdv)] == ["live"]
        assert os.path.exists(live.endpoint[len("ipc://") :])
    finally:
        live.stop()


def test_static_peer_list_over_tcp_on_loopback(tmp_path):
    """Without a shared rendezvous directory, a configured peer list suffices; TCP binds
    127.0.0.1 by default."""
    secret = str(tmp_path / "secret")
    donor = ControlAgent(
        _cfg(str(tmp_path / "a"), "donor", transport="tcp", secret_file=secret), memory=MEM
    ).start()
    try:
        assert donor.endpoint.startswith("tcp://127.0.0.1:")
        borrower = ControlAgent(
            _cfg(
                str(tmp_path / "b"),
                "borrower",
                transport="tcp",
                secret_file=secret,
                peers=(donor.endpoint,),
            )
        ).start()
        try:
            donor.offer(range(8))
            assert borrower.wait_until(
                lambda a: "donor" in a.peers and a.peers["donor"].lendable == 8, 5
            )
            borrower.request(8)
            assert len(next_event(borrower, LeaseGranted).blocks) == 8
        finally:
            borrower.stop()
    finally:
        donor.stop()


def test_low_watermark_triggers_reclaim_and_reserve_is_kept(rdv):
    """The donor's owner reporting free memory under the watermark takes blocks back, first
    the reserve (never lent), then leased blocks through reclaim."""
    donor = ControlAgent(
        _cfg(rdv, "donor", reserve_blocks=4, low_watermark_blocks=10), memory=MEM
    ).start()
    borrower = ControlAgent(_cfg(rdv, "borrower")).start()
    try:
        donor.offer(range(32))
        assert borrower.wait_until(
            lambda a: "donor" in a.peers and a.peers["donor"].lendable == 28, 5
        )
        borrower.request(32)
        assert len(next_event(borrower, LeaseGranted).blocks) == 28  # the reserve stays home
        donor.report_free(4)  # the owner has 4 free blocks, wants 10: needs 6 back
        assert len(next_event(donor, BlocksReturned).blocks) == 4
        rec = next_event(borrower, ReclaimRequested)
        assert len(rec.blocks) == 2
        borrower.ack_reclaim(rec)
        assert len(next_event(donor, BlocksReturned).blocks) == 2
        donor.check_integrity()
    finally:
        borrower.stop()
        donor.stop()


def test_manual_mode_agent_is_pumped_by_its_owner(rdv):
    """Started with thread=False, an agent does its I/O only inside pump(), which never
    blocks longer than asked; it borrows and acknowledges like a threaded one."""
    donor = ControlAgent(_cfg(rdv, "donor"), memory=MEM).start()
    borrower = ControlAgent(_cfg(rdv, "borrower")).start(thread=False)

    def pump_until(kind, timeout=5.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            borrower.pump(0.01)
            assert time.monotonic() - t0 < 0.5
            for e in borrower.poll_events():
                if isinstance(e, kind):
                    return e
        raise AssertionError(f"no {kind.__name__}")

    try:
        donor.offer(range(32))
        for _ in range(100):
            borrower.pump(0.01)
            if "donor" in borrower.peers and borrower.peers["donor"].lendable:
                break
        borrower.request(8)
        grant = pump_until(LeaseGranted)
        donor.demand(30)
        rec = pump_until(ReclaimRequested)
        borrower.ack_reclaim(rec)
        borrower.pump(0)
        assert donor.wait_until(lambda a: a.status().lent == 2, 5)
        assert len(grant.blocks) == 8
    finally:
        borrower.stop()
        donor.stop()


def test_grant_arriving_after_the_request_timed_out_is_given_back(rdv):
    """A grant for a request the borrower already gave up on is released at once, so a slow
    donor never leaks blocks to a borrower that does not know it holds them."""
    slow = dict(heartbeat_interval_s=0.05, heartbeat_timeout_s=3.0, lease_margin_s=0.5)
    donor = ControlAgent(ControlConfig("donor", rendezvous_dir=rdv, **slow), memory=MEM).start()
    borrower = ControlAgent(
        ControlConfig("borrower", rendezvous_dir=rdv, request_timeout_s=0.2, **slow)
    ).start()
    try:
        donor.offer(range(32))
        assert borrower.wait_until(lambda a: "donor" in a.peers and a.peers["donor"].lendable, 5)
        with donor._lock:  # stall the donor's I/O thread until the borrower gives up
            rid = borrower.request(4)
            failed = next_event(borrower, RequestFailed)
            assert (failed.request_id, failed.reason) == (rid, "timeout")
        assert borrower.wait_until(lambda a: a.counters.get("grants_refused", 0) == 1, 5)
        assert donor.wait_until(lambda a: a.status().lent == 0, 5)
        assert not borrower.status().leases
    finally:
        borrower.stop()
        donor.stop()
