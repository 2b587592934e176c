"""Borrower half of an agent: requests leases, tracks what it may read, answers reclaims.

Read safety is a lease with an expiry on CLOCK_MONOTONIC. Each held lease keeps ``vouched``, a
time (ours) at which the donor still held the lease for us and had just heard from us: the send
time of our request (grant), of a heartbeat the donor echoed back, or of a Revalidate it
answered. A donor declares a live-looking borrower dead no earlier than ``dead_after_s`` after
it last heard from it (liveness.py), so we may read the lease until ``vouched +
read_validity_s`` (``dead_after_s - lease_margin_s``), which is earlier. (Death by a process
check needs our process gone, and then nothing reads.)

Past that deadline a lease is *stale*, not lost: nothing may read it and heartbeat echoes do not
revive it (the donor may have declared us dead and met us again since). Instead we ask the donor
(Revalidate, once per heartbeat interval until it answers): leases it still holds for us are
vouched again from the probe's send time, same epoch, same lease, same blocks, so what the tree
stored in them stays; the others are lost. Otherwise a lease is lost only when its donor is
declared dead, restarts, leaves, or says it forgot us.
Runs on the agent's I/O thread only; the agent serialises access with its lock.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sglang_swift.control import protocol as p
from sglang_swift.control.events import (
    LeaseGranted,
    LeaseKey,
    LeaseLost,
    ReclaimRequested,
    RequestFailed,
)

if TYPE_CHECKING:
    from sglang_swift.control.agent import ControlAgent
    from sglang_swift.control.peers import Peer

log = logging.getLogger(__name__)


@dataclass
class LeaseHolding:
    key: LeaseKey
    active: set[int]
    memory: p.MemoryDescriptor
    vouched: float  # CLOCK_MONOTONIC time the donor last held this lease for us (see above)
    reclaiming: dict[int, set[int]] = field(default_factory=dict)

    def blocks(self) -> set[int]:
        """Every block of the lease, readable or being reclaimed."""
        return self.active.union(*self.reclaiming.values())


@dataclass
class _Pending:
    donor: str
    sent_at: float
    num_blocks: int


class BorrowerSide:
    def __init__(self, agent: ControlAgent) -> None:
        self.agent = agent
        cfg = agent.config
        self._validity = cfg.read_validity_s
        self._probe_every = cfg.heartbeat_interval_s
        self.pending: dict[int, _Pending] = {}
        self.leases: dict[LeaseKey, LeaseHolding] = {}
        self._probed: dict[str, float] = {}  # donor -> when we last asked it to re-validate
        self._probe_ids = itertools.count(1)

    def read_deadline(self, donor: str, lease_id: int | None = None) -> float:
        """CLOCK_MONOTONIC time until which `donor`'s blocks (of lease `lease_id` only, when
        given) may be read: the earliest deadline among the matching leases; 0.0 if none."""
        return min(
            (
                held.vouched + self._validity
                for key, held in self.leases.items()
                if key.donor == donor and lease_id in (None, key.lease_id)
            ),
            default=0.0,
        )

    def stale(self, donor: str, now: float) -> list[int]:
        """Ids of `donor`'s leases whose read deadline has passed (awaiting re-validation)."""
        return [
            key.lease_id
            for key, held in self.leases.items()
            if key.donor == donor and now > held.vouched + self._validity
        ]

    def borrowed(self) -> int:
        return sum(len(h.blocks()) for h in self.leases.values())

    # ---- owner commands ----
    def request(self, request_id: int, num_blocks: int, priority: int, donor: str | None) -> None:
        peer = self.agent.pick_donor(num_blocks) if donor is None else self.agent.peers.get(donor)
        if peer is None:
            self.agent.emit(RequestFailed(request_id, donor or "", "no_donor"))
            return
        self.pending[request_id] = _Pending(peer.agent_id, time.monotonic(), num_blocks)
        self.agent.send(peer, p.LeaseRequest(request_id, num_blocks, priority))

    def ack(self, key: LeaseKey, reclaim_id: int) -> None:
        held = self.leases.get(key)
        blocks = held.reclaiming.pop(reclaim_id, None) if held else None
        if blocks is None:
            return  # lease lost meanwhile, or a duplicate ack: nothing is owed
        self._send_to_donor(key, p.ReclaimAck(reclaim_id, key.lease_id, key.epoch, sorted(blocks)))
        self._forget_if_empty(held)

    def release(self, key: LeaseKey, blocks) -> None:
        held = self.leases.get(key)
        if held is None:
            return
        gone = held.blocks() if blocks is None else held.blocks() & set(blocks)
        held.active -= gone
        for rid in list(held.reclaiming):
            held.reclaiming[rid] -= gone
            if not held.reclaiming[rid]:
                del held.reclaiming[rid]
        self._send_to_donor(key, p.Release(key.lease_id, key.epoch, sorted(gone)))
        self._forget_if_empty(held)

    # ---- messages from donors ----
    def on_grant(self, peer, msg: p.Grant) -> None:
        key = LeaseKey(peer.agent_id, peer.epoch, msg.lease_id)
        pend = self.pending.get(msg.request_id)
        if pend is not None and pend.donor == peer.agent_id:
            del self.pending[msg.request_id]
        else:
            pend = None
        bad = self._check_grant(peer, msg, key)
        if pend is None or bad:
            log.warning(
                "release unexpected grant %s from %s: %s",
                msg.lease_id,
                peer.agent_id,
                bad or "no pending request (timed out?)",
            )
            self.agent.count("grants_refused")
            if msg.epoch == peer.epoch and not (bad and "twice" in bad):
                self.agent.send(peer, p.Release(msg.lease_id, msg.epoch, list(msg.blocks)))
            if pend is not None:  # the owner still gets an answer to its request
                self.agent.emit(RequestFailed(msg.request_id, peer.agent_id, "bad_grant"))
            return
        # The donor granted after it received the request, so it held the lease for us then.
        self.leases[key] = LeaseHolding(key, set(msg.blocks), msg.memory, vouched=pend.sent_at)
        self.agent.emit(LeaseGranted(msg.request_id, key, tuple(msg.blocks), msg.memory))

    def _check_grant(self, peer, msg: p.Grant, key: LeaseKey) -> str:
        if msg.epoch != peer.epoch:
            return f"epoch {msg.epoch} != donor epoch {peer.epoch}"
        if key in self.leases:
            return "lease id granted twice"
        if len(set(msg.blocks)) != len(msg.blocks) or not msg.blocks:
            return "empty or duplicate blocks"
        if any(b >= msg.memory.num_ids for b in msg.blocks):  # a donor's pool: its page ids
            return "block id beyond the descriptor"
        mine = set(msg.blocks)
        for held in self.leases.values():
            if held.key.donor == key.donor and held.key.epoch == key.epoch:
                if mine & (held.blocks()):
                    return "block granted twice"
        return ""

    def on_reclaim(self, peer, msg: p.Reclaim) -> None:
        key = LeaseKey(peer.agent_id, peer.epoch, msg.lease_id)
        held = self.leases.get(key)
        if msg.epoch != peer.epoch or held is None:
            self.agent.count("stale_reclaims")
            return
        if msg.reclaim_id in held.reclaiming:
            return  # a resend; the owner was told already
        blocks = held.active & set(msg.blocks)
        held.active -= blocks
        held.reclaiming[msg.reclaim_id] = blocks
        if not blocks:  # released before the reclaim arrived: ack at once
            self.ack(key, msg.reclaim_id)
            return
        deadline = time.monotonic() + msg.deadline_ms / 1000
        self.agent.emit(ReclaimRequested(key, msg.reclaim_id, tuple(sorted(blocks)), deadline))

    def on_error(self, peer_id: str, msg: p.Error) -> None:
        pend = self.pending.get(msg.ref)
        if (
            pend is not None
            and pend.donor == peer_id
            and msg.code in (p.E_NO_CAPACITY, p.E_NOT_DONOR, p.E_INVALID)
        ):
            del self.pending[msg.ref]
            self.agent.emit(RequestFailed(msg.ref, peer_id, msg.code))

    def on_echo(self, peer: Peer, echo_ns: int) -> None:
        """The donor heard our heartbeat sent at ``echo_ns``: it held our live leases then. A
        stale lease is not revived this way (only Revalidated can: the donor may have declared
        us dead and met us again since)."""
        now = time.monotonic()
        echoed = min(echo_ns / 1e9, now)
        for key, held in self.leases.items():
            if key.donor == peer.agent_id and key.epoch == peer.epoch:
                if now <= held.vouched + self._validity and echoed > held.vouched:
                    held.vouched = echoed

    def on_revalidated(self, peer: Peer, msg: p.Revalidated) -> None:
        now = time.monotonic()
        echoed = min(msg.echo_ns / 1e9, now)
        for lease_id in msg.valid:
            held = self.leases.get(LeaseKey(peer.agent_id, peer.epoch, lease_id))
            if held is not None and echoed > held.vouched:
                if now > held.vouched + self._validity:
                    self.agent.count("leases_revalidated")
                    log.info("lease %s re-validated by its donor; reading it again", held.key)
                held.vouched = echoed
        for lease_id in msg.invalid:
            key = LeaseKey(peer.agent_id, peer.epoch, lease_id)
            if key in self.leases:
                self._lose(key, "dropped by the donor")
        if not self.stale(peer.agent_id, now):
            self._probed.pop(peer.agent_id, None)  # the next stale lease is a new episode

    # ---- time and loss ----
    def tick(self, now: float) -> None:
        timeout = self.agent.config.request_timeout_s
        for rid, pend in list(self.pending.items()):
            if now - pend.sent_at > timeout:
                del self.pending[rid]
                self.agent.emit(RequestFailed(rid, pend.donor, "timeout"))
        for donor in {k.donor for k in self.leases}:
            self._revalidate(donor, now)

    def _revalidate(self, donor: str, now: float) -> None:
        """Ask `donor` about our stale leases, at most once per heartbeat interval."""
        stale = self.stale(donor, now)
        peer = self.agent.peers.get(donor)
        if not stale or peer is None or now - self._probed.get(donor, -1e9) < self._probe_every:
            return
        if donor not in self._probed:
            log.warning(
                "leases %s from %s: no word vouching for them for %.1fs; not reading them, "
                "asking the donor to re-validate", stale[:8], donor, self._validity,
            )
        self._probed[donor] = now
        self.agent.count("revalidations_sent")
        probe = p.Revalidate(next(self._probe_ids), time.monotonic_ns(), stale[:4096])
        self.agent.send(peer, probe)

    def lose_donor(self, donor: str, epoch: int | None, reason: str) -> None:
        """Drop every lease from ``donor`` (of ``epoch``, or all) and fail its requests."""
        for key in [k for k in self.leases if k.donor == donor and epoch in (None, k.epoch)]:
            self._lose(key, reason)
        for rid in [r for r, pd in self.pending.items() if pd.donor == donor]:
            del self.pending[rid]
            self.agent.emit(RequestFailed(rid, donor, reason))
        self._probed.pop(donor, None)

    def _lose(self, key: LeaseKey, reason: str) -> None:
        blocks = self.leases.pop(key).blocks()
        (log.info if reason == "left" else log.warning)(
            "lease %s lost (%s): %d blocks", key, reason, len(blocks)
        )
        self.agent.emit(LeaseLost(key, tuple(sorted(blocks)), reason))

    def _send_to_donor(self, key: LeaseKey, msg) -> None:
        peer = self.agent.peers.get(key.donor)
        if peer is not None and peer.epoch == key.epoch:
            self.agent.send(peer, msg)

    def _forget_if_empty(self, held: LeaseHolding) -> None:
        if not held.active and not held.reclaiming:
            self.leases.pop(held.key, None)

    def check_integrity(self) -> None:
        seen: dict[tuple[str, int], set[int]] = {}
        for key, held in self.leases.items():
            blocks = [*held.active, *(b for rb in held.reclaiming.values() for b in rb)]
            mine = set(blocks)
            assert len(mine) == len(blocks), f"{key} lists a block twice"
            prev = seen.setdefault((key.donor, key.epoch), set())
            assert not prev & mine, f"{key} overlaps another lease: {sorted(prev & mine)[:8]}"
            prev |= mine
            assert held.vouched <= time.monotonic(), f"{key} vouched for in the future"
