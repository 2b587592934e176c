"""Liveness of peers: when a silent peer is suspected, when it is declared dead, and the donor's
answer to a borrower that re-validates its leases. docs/liveness.md has the reasoning.

Silence is not death. A peer can be silent because its process is gone, or because it is alive
but did not run (a long forward holding the interpreter lock, a CPU starved by other processes,
SIGSTOP). Only the first may cost a borrower its leases, so after ``heartbeat_timeout_s`` of
silence a peer is *suspect*, and it is declared dead only on evidence:

* ``heartbeat timeout``: it is on this host (same boot and pid namespace) and its process is
  gone (the pid is free, a zombie, or reused by a process that started later);
* ``connection closed``: our connection to its socket has been down for a heartbeat timeout
  (nothing listens there any more: a process on another host or namespace that exited);
* ``unresponsive``: no word from it for ``dead_after_s``, whatever its process seems to be.

A borrower's read deadline ends ``lease_margin_s`` before the last of these can happen, so a
donor may reuse a dead borrower's blocks at once. Our own pauses do not count as a peer's
silence: after a tick gap longer than the heartbeat timeout, every peer's silence is shifted
by the gap (declaring death later is always safe).

When a dead peer is found: the agent checks at every tick (twice per heartbeat interval), so a
peer whose process is gone is declared dead within ``heartbeat_timeout_s`` of its last message
plus one tick, or one tick after the process went if it was already silent that long (stopped
before it was killed). Later only by this agent's own pauses: a thread that does not run finds
nothing, and the silence it slept through is not counted against the peer, so a pause of ``g``
(counters ``own_pauses``, ``max_own_pause_ms``) can delay the verdict by up to ``g`` plus
``heartbeat_timeout_s``. ``PeerChanged.at`` is the instant of the verdict.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from sglang_swift.common import private_resources
from sglang_swift.common.process import host_identity, process_alive, process_start_time
from sglang_swift.control import discovery
from sglang_swift.control import protocol as p

if TYPE_CHECKING:
    from sglang_swift.control.agent import ControlAgent
    from sglang_swift.control.peers import Peer

log = logging.getLogger(__name__)


class Liveness:
    def __init__(self, agent: ControlAgent) -> None:
        self.agent = agent
        self.host = host_identity()
        self.pid_start = process_start_time(os.getpid())
        self._last_tick = 0.0

    def same_host(self, peer: Peer) -> bool:
        """Whether `peer.pid` names a process we can see (so its death can be checked)."""
        return bool(self.host) and peer.host == self.host

    def process_gone(self, peer: Peer) -> bool:
        return self.same_host(peer) and not process_alive(peer.pid, peer.pid_start)

    def heard(self, peer: Peer, now: float) -> None:
        """A message from `peer` arrived: note the gap it ended, clear a suspicion."""
        gap_ms = int((now - peer.last_rx) * 1000)
        if gap_ms > peer.max_silence_ms:
            peer.max_silence_ms = gap_ms
            counters = self.agent.counters
            counters["max_silence_ms"] = max(counters.get("max_silence_ms", 0), gap_ms)
        if peer.suspect_since:
            log.info(
                "peer %s epoch %d answered again after %.1fs of silence; its leases stand",
                peer.agent_id, peer.epoch, gap_ms / 1000,
            )
            peer.suspect_since = 0.0
        peer.last_rx = now

    def own_pause(self, now: float) -> None:
        """Called at every tick: if this agent itself did not run for longer than the heartbeat
        timeout, its peers' silence over that time is ours, not theirs."""
        gap = now - self._last_tick if self._last_tick else 0.0
        self._last_tick = now
        if gap <= self._timeout():
            return
        a = self.agent
        a.count("own_pauses")
        a.counters["max_own_pause_ms"] = max(a.counters.get("max_own_pause_ms", 0), int(gap * 1000))
        log.warning("control agent %s did not run for %.1fs (busy or starved process); "
                    "not counting that against its peers", a.config.agent_id, gap)
        for peer in a.peers.values():
            peer.last_rx = min(now, peer.last_rx + gap)

    def verdict(self, peer: Peer, now: float) -> str:
        """Why `peer` is dead now ("" while it is alive or only suspect)."""
        cfg = self.agent.config
        silent = now - peer.last_rx
        if silent <= cfg.heartbeat_timeout_s:
            return ""
        if not peer.suspect_since:
            peer.suspect_since = now
            self.agent.count("suspicions")
        if self.process_gone(peer):
            return "heartbeat timeout"
        if self.agent.link.closed_for(peer.endpoint, now) > cfg.heartbeat_timeout_s:
            return "connection closed"
        if silent > cfg.dead_after_s:
            return "unresponsive"
        if peer.suspect_since == now:
            log.info(
                "peer %s epoch %d silent for %.1fs but %s; keeping its leases (dead after %.0fs)",
                peer.agent_id, peer.epoch, silent,
                "its process is alive" if self.same_host(peer) else "its socket is connected",
                cfg.dead_after_s,
            )
        return ""

    def buried(self, peer: Peer) -> None:
        """`peer` was declared dead: remove what its process left on the node, if it is gone."""
        if not self.process_gone(peer):
            return
        removed = private_resources.sweep_shm(peer.pid)
        removed += discovery.sweep(self.agent.config.rendezvous_dir, peer.pid)
        if removed:
            self.agent.count("swept", len(removed))

    def on_revalidate(self, peer: Peer, msg: p.Revalidate) -> None:
        """Donor side: tell the borrower which of the asked leases it still holds. A lease is
        the borrower's while the ledger has it for this borrower and epoch; lease ids are
        never reused within our epoch, so "absent" means "dropped", never "someone else's"."""
        leases = self.agent.donor.ledger.leases
        valid, invalid = [], []
        for lease_id in msg.lease_ids:
            lease = leases.get(lease_id)
            mine = (
                lease is not None
                and lease.borrower == peer.agent_id
                and lease.borrower_epoch == peer.epoch
            )
            (valid if mine else invalid).append(lease_id)
        self.agent.count("revalidations_answered")
        self.agent.send(peer, p.Revalidated(msg.probe_id, msg.sent_ns, valid, invalid))

    def _timeout(self) -> float:
        return self.agent.config.heartbeat_timeout_s
