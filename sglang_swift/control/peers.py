"""Membership of an agent: handshake, authentication checks, heartbeats, failure detection,
discovery, and dispatch of peer messages to the donor and borrower halves.

Rules that keep stale or hostile input harmless:
* a frame that fails decoding (size, magic, version, HMAC, schema) is counted, logged and
  answered with Error when it came to our ROUTER; state is never touched;
* only Hello creates a peer; a newer epoch in a Hello means the old incarnation is gone
  (its leases are dropped on both sides); frames from older epochs are dropped;
* frames addressed to another epoch of ours (``to_epoch``) are dropped, as are replays
  (``seq`` not increasing);
* a peer silent for ``heartbeat_timeout_s`` is suspect, and declared dead only on evidence
  (liveness.py): its process gone, its socket closed, or ``dead_after_s`` of silence. Then its
  borrowed blocks return to us, and leases we hold from it are dropped.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglang_swift.control import discovery
from sglang_swift.control import protocol as p
from sglang_swift.control.status import agent_status

if TYPE_CHECKING:
    from sglang_swift.control.agent import ControlAgent

log = logging.getLogger(__name__)


@dataclass
class Peer:
    agent_id: str
    epoch: int
    endpoint: str
    pid: int
    model: str
    hello: p.Hello
    last_rx: float
    last_seq: int = 0
    echo_ns: int = 0
    lendable: int = 0
    host: str = ""  # its host_identity(); equal to ours means its pid can be checked
    pid_start: int = 0
    suspect_since: float = 0.0  # 0.0: not suspect
    max_silence_ms: int = 0


class PeerTable:
    def __init__(self, agent: ControlAgent) -> None:
        self.agent = agent
        self._hello_sent: dict[tuple[str, int], float] = {}  # (id or endpoint, epoch) -> time
        self._next_discovery = 0.0
        self._next_beat = 0.0
        self._records: dict = {}  # rendezvous file cache, see discovery.read_records

    # ---- receive ----
    def on_frames(self, frames: list[bytes], rid: bytes | None, source: str) -> None:
        a = self.agent
        a.count("msgs_in")
        try:
            if len(frames) != 1:
                raise p.BadMessage(p.E_MALFORMED, f"{len(frames)} frames, expected 1")
            env = a.codec.decode(frames[0])
        except p.BadMessage as err:
            a.on_bad(err, source)
            if rid is not None:
                a.reply(rid, p.Error(err.code, err.detail[:200]))
            return
        body = env.body
        if isinstance(body, p.StatusRequest):
            if rid is not None:
                a.reply(rid, p.StatusReply(agent_status(a)))
            return
        if env.sender == a.config.agent_id:
            return self._refuse(rid, env, p.E_INVALID, "sender claims our own agent id")
        if isinstance(body, p.Hello):
            return self._on_hello(env, body, rid)
        peer = a.peers.get(env.sender)
        if isinstance(body, p.Error):
            return self._on_error(env, body, peer)
        if peer is None or env.epoch > peer.epoch:
            return self._refuse(rid, env, p.E_UNKNOWN_PEER, "send hello first")
        if env.epoch < peer.epoch or env.to_epoch != a.epoch:
            return a.on_refused(
                "stale",
                f"(peer epoch now {peer.epoch}; sent to our epoch "
                f"{env.to_epoch}, ours is {a.epoch})",
                env,
            )
        if source == "router":
            if env.seq <= peer.last_seq:
                return a.on_refused("replayed", f"seq {env.seq} <= {peer.last_seq}", env)
            peer.last_seq = env.seq
        a.liveness.heard(peer, time.monotonic())
        self._dispatch(peer, body)

    def _dispatch(self, peer, body) -> None:
        a = self.agent
        if isinstance(body, p.Heartbeat):
            peer.echo_ns, peer.lendable = body.sent_ns, body.lendable
            a.borrower.on_echo(peer, body.echo_ns)
        elif isinstance(body, p.Advertise):
            peer.lendable = body.lendable
            a.notify()
        elif isinstance(body, p.LeaseRequest):
            a.donor.on_request(peer, body)
        elif isinstance(body, p.Release):
            a.donor.on_release(peer, body)
        elif isinstance(body, p.ReclaimAck):
            a.donor.on_ack(peer, body)
        elif isinstance(body, p.Grant):
            a.borrower.on_grant(peer, body)
        elif isinstance(body, p.Reclaim):
            a.borrower.on_reclaim(peer, body)
        elif isinstance(body, p.Revalidate):
            a.liveness.on_revalidate(peer, body)
        elif isinstance(body, p.Revalidated):
            a.borrower.on_revalidated(peer, body)
        elif isinstance(body, p.Bye):
            self.lose(peer, "left")
        else:
            a.count("unexpected")

    def _refuse(self, rid: bytes | None, env: p.Envelope, code: str, detail: str) -> None:
        self.agent.on_refused("refused_" + code, detail, env)
        if rid is not None:
            self.agent.reply(rid, p.Error(code, detail))

    def _on_error(self, env: p.Envelope, body: p.Error, peer) -> None:
        a = self.agent
        a.count("errors_in")
        if peer is None or env.epoch != peer.epoch:
            log.info(
                "error from %s (not a current peer): %s %s", env.sender, body.code, body.detail
            )
            return
        if body.code == p.E_UNKNOWN_PEER:  # it declared us dead: our leases there are void
            if env.seq <= peer.last_seq:  # but it has spoken to us since: an old error
                return a.on_refused("stale", "unknown_peer error older than the peer's news", env)
            a.borrower.lose_donor(peer.agent_id, peer.epoch, "donor forgot us")
            a.donor.drop_borrower(peer.agent_id)
            a.send(peer, self._hello(reply=True))
        else:
            if body.code not in (p.E_NO_CAPACITY,):
                log.warning("error from %s: %s %s", env.sender, body.code, body.detail)
            a.borrower.on_error(peer.agent_id, body)

    def _on_hello(self, env: p.Envelope, hello: p.Hello, rid: bytes | None) -> None:
        a = self.agent
        if hello.protocol_version != p.PROTOCOL_VERSION:
            return self._refuse(
                rid, env, p.E_VERSION, f"protocol {hello.protocol_version} unsupported"
            )
        peer = a.peers.get(env.sender)
        if peer is not None and env.epoch < peer.epoch:
            return a.on_refused("stale", "hello from an older incarnation", env)
        if peer is not None and env.epoch > peer.epoch:
            self.lose(peer, "restarted")
            peer = None
        now = time.monotonic()
        if peer is None:
            peer = Peer(
                env.sender,
                env.epoch,
                hello.endpoint,
                hello.pid,
                hello.model,
                hello,
                last_rx=now,
                last_seq=env.seq,
                host=hello.host,
                pid_start=hello.pid_start,
            )
            a.peers[peer.agent_id] = peer
            log.info(
                "peer %s epoch %d joined (%s, %s)",
                peer.agent_id,
                peer.epoch,
                hello.model,
                hello.endpoint,
            )
            a.peer_changed(peer, joined=True)
        else:
            a.liveness.heard(peer, now)
            peer.last_seq = max(peer.last_seq, env.seq)
        if hello.reply:
            a.send(peer, self._hello(reply=False))

    def _hello(self, reply: bool) -> p.Hello:
        a, mem = self.agent, self.agent.donor.memory
        return p.Hello(
            p.PROTOCOL_VERSION,
            a.model,
            a.endpoint,
            os.getpid(),
            mem.block_bytes if mem else 0,
            mem.num_blocks if mem else 0,
            mem.device if mem else "",
            reply,
            a.liveness.host,
            a.liveness.pid_start,
            mem.layout if mem else None,
        )

    # ---- time ----
    def tick(self, now: float) -> None:
        a = self.agent
        cfg = a.config
        a.liveness.own_pause(now)
        beat = now >= self._next_beat
        if beat:
            self._next_beat = now + cfg.heartbeat_interval_s
        for peer in list(a.peers.values()):
            reason = a.liveness.verdict(peer, now)
            if reason:
                self.lose(peer, reason)
            elif beat:
                hb = p.Heartbeat(time.monotonic_ns(), peer.echo_ns, a.donor.ledger.lendable())
                a.send(peer, hb)
        if now >= self._next_discovery:
            self._next_discovery = now + cfg.discovery_interval_s
            self._discover(now)

    def _discover(self, now: float) -> None:
        a = self.agent
        for rec in discovery.read_records(a.config.rendezvous_dir, self._records):
            if rec.agent_id == a.config.agent_id or not discovery.pid_alive(rec.pid):
                continue
            known = a.peers.get(rec.agent_id)
            if known is not None and known.epoch >= rec.epoch:
                continue
            self._say_hello(rec.endpoint, rec.agent_id, rec.epoch, now)
        known_endpoints = {q.endpoint for q in a.peers.values()}
        for endpoint in a.config.peers:
            if endpoint not in known_endpoints and endpoint != a.endpoint:
                self._say_hello(endpoint, endpoint, 0, now)

    def _say_hello(self, endpoint: str, name: str, epoch: int, now: float) -> None:
        sent = self._hello_sent.get((name, epoch))
        if sent is not None and now - sent < 1.0:
            return
        self._hello_sent[(name, epoch)] = now
        self.agent.send_to(endpoint, epoch, self._hello(reply=True))

    def lose(self, peer, reason: str) -> None:
        """The peer's incarnation is gone: free what it borrowed, drop what we borrowed."""
        a = self.agent
        if a.peers.get(peer.agent_id) is not peer:
            return
        del a.peers[peer.agent_id]
        a.count("peers_lost")
        (log.info if reason == "left" else log.warning)(
            "peer %s epoch %d lost: %s", peer.agent_id, peer.epoch, reason
        )
        a.donor.drop_borrower(peer.agent_id)
        a.borrower.lose_donor(peer.agent_id, peer.epoch, reason)
        if peer.endpoint not in {q.endpoint for q in a.peers.values()}:
            a.link.close_dealer(peer.endpoint)
        self._hello_sent = {k: v for k, v in self._hello_sent.items() if k[0] != peer.agent_id}
        a.peer_changed(peer, joined=False, reason=reason)
        a.liveness.buried(peer)
