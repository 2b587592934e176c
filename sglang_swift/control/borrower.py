"""Borrower half of an agent: requests leases, tracks what it may read, answers reclaims.

Read safety is a lease with an expiry on the node-wide CLOCK_MONOTONIC. A donor's heartbeat
echoes the send time of the last heartbeat it received from us, so ``confirmed`` is a moment at
which the donor still knew we were alive. We may read the donor's blocks only until
``confirmed + heartbeat_timeout - lease_margin``; the donor declares us dead (and reuses our
blocks) no earlier than ``heartbeat_timeout`` after it last heard from us, which is later. So a
live but slow borrower stops reading before a donor that gave up on it reuses anything.
Runs on the agent's I/O thread only; the agent serialises access with its lock.
"""

from __future__ import annotations

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

log = logging.getLogger(__name__)


@dataclass
class LeaseHolding:
    key: LeaseKey
    active: set[int]
    memory: p.MemoryDescriptor
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
        self._validity = cfg.heartbeat_timeout_s - cfg.lease_margin_s
        self.pending: dict[int, _Pending] = {}
        self.leases: dict[LeaseKey, LeaseHolding] = {}
        self.confirmed: dict[str, float] = {}  # donor -> monotonic time it last heard us

    def read_deadline(self, donor: str) -> float:
        return self.confirmed.get(donor, 0.0) + self._validity

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
        self._expire(peer.agent_id, time.monotonic())
        self.confirmed[peer.agent_id] = max(self.confirmed.get(peer.agent_id, 0.0), pend.sent_at)
        self.leases[key] = LeaseHolding(key, set(msg.blocks), msg.memory)
        self.agent.emit(LeaseGranted(msg.request_id, key, tuple(msg.blocks), msg.memory))

    def _check_grant(self, peer, msg: p.Grant, key: LeaseKey) -> str:
        if msg.epoch != peer.epoch:
            return f"epoch {msg.epoch} != donor epoch {peer.epoch}"
        if key in self.leases:
            return "lease id granted twice"
        if len(set(msg.blocks)) != len(msg.blocks) or not msg.blocks:
            return "empty or duplicate blocks"
        if any(b >= msg.memory.num_blocks for b in msg.blocks):
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

    def on_echo(self, donor: str, echo_ns: int) -> None:
        self._expire(donor, time.monotonic())  # never revive a lease whose deadline passed
        echoed = min(echo_ns / 1e9, time.monotonic())
        if echoed > self.confirmed.get(donor, 0.0):
            self.confirmed[donor] = echoed

    # ---- time and loss ----
    def tick(self, now: float) -> None:
        timeout = self.agent.config.request_timeout_s
        for rid, pend in list(self.pending.items()):
            if now - pend.sent_at > timeout:
                del self.pending[rid]
                self.agent.emit(RequestFailed(rid, pend.donor, "timeout"))
        for donor in {k.donor for k in self.leases}:
            self._expire(donor, now)

    def _expire(self, donor: str, now: float) -> None:
        if now > self.read_deadline(donor) and any(k.donor == donor for k in self.leases):
            self.lose_donor(donor, None, "lease expired", tell=True)

    def lose_donor(self, donor: str, epoch: int | None, reason: str, tell: bool = False) -> None:
        """Drop every lease from ``donor`` (of ``epoch``, or all). ``tell``: the donor may be
        alive, so send Release for what we dropped (we stopped reading already)."""
        for key in [k for k in self.leases if k.donor == donor and epoch in (None, k.epoch)]:
            held = self.leases.pop(key)
            blocks = held.blocks()
            if tell:
                self._send_to_donor(key, p.Release(key.lease_id, key.epoch, sorted(blocks)))
            log.info("lease %s lost (%s): %d blocks", key, reason, len(blocks))
            self.agent.emit(LeaseLost(key, tuple(sorted(blocks)), reason))
        for rid in [r for r, pd in self.pending.items() if pd.donor == donor]:
            del self.pending[rid]
            self.agent.emit(RequestFailed(rid, donor, reason))
        self.confirmed.pop(donor, None)

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
