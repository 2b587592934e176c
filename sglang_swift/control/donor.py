"""Donor half of an agent: lends offered blocks, and takes them back when its owner needs them.

The owner's demand always wins: ``demand(n)`` (or a free-memory report below the configured
watermark) first returns free blocks, reserve included, then reclaims leased ones. A reclaimed
block stays unusable until its borrower acknowledges, releases it, or is declared dead; only
then is it handed to the owner (``BlocksReturned``). Pending reclaims are re-sent after their
deadline. Runs on the agent's I/O thread only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from sglang_swift.control import protocol as p
from sglang_swift.control.events import BlocksReturned
from sglang_swift.control.grant_policy import create_policy
from sglang_swift.control.ledger import DonorLedger, PendingReclaim

if TYPE_CHECKING:
    from sglang_swift.control.agent import ControlAgent

log = logging.getLogger(__name__)


class DonorSide:
    def __init__(self, agent: ControlAgent) -> None:
        self.agent = agent
        cfg = agent.config
        self.ledger = DonorLedger(
            create_policy(cfg.policy), cfg.reserve_blocks, cfg.max_blocks_per_borrower
        )
        self.memory: p.MemoryDescriptor | None = None
        self._sent_at: dict[int, float] = {}  # reclaim_id -> last (re)send time
        self._advertised = -1

    def set_memory(self, memory: p.MemoryDescriptor) -> None:
        if self.memory is not None and self.ledger.offered:
            raise RuntimeError("memory descriptor changed while blocks are offered")
        # The region's own identity (checked by the borrower against the mapped region's header)
        # wins; a descriptor without one is named after this agent's incarnation.
        uuid = memory.owner_uuid or f"{self.agent.config.agent_id}:{self.agent.epoch}"
        self.memory = msgspec.structs.replace(memory, owner_uuid=uuid)

    # ---- owner commands ----
    def offer(self, blocks) -> None:
        if self.memory is None:
            raise RuntimeError("set_memory() before offering blocks")
        blocks = list(blocks)
        bad = [b for b in blocks if not 0 <= b < self.memory.num_ids]
        if bad:
            raise ValueError(f"blocks outside the lent memory: {bad[:8]}")
        self._returned(self.ledger.offer(blocks))

    def demand(self, n: int) -> None:
        now, reclaims = self.ledger.demand(n)
        self._returned(now)
        self._send_reclaims(reclaims)

    def report_free(self, owner_free: int) -> None:
        need = self.agent.config.low_watermark_blocks - owner_free - self.ledger.owner_debt
        if need > 0:
            self.demand(need)

    # ---- messages from borrowers ----
    def on_request(self, peer, msg: p.LeaseRequest) -> None:
        if self.memory is None:
            self.agent.send(peer, p.Error(p.E_NOT_DONOR, "no memory to lend", msg.request_id))
            return
        if msg.block_bytes and msg.block_bytes != self.memory.block_bytes:
            detail = f"block_bytes {msg.block_bytes} != {self.memory.block_bytes}"
            self.agent.send(peer, p.Error(p.E_INVALID, detail, msg.request_id))
            return
        lease = self.ledger.grant(peer.agent_id, peer.epoch, msg.num_blocks, msg.priority)
        if lease is None:
            self.agent.send(peer, p.Error(p.E_NO_CAPACITY, "", msg.request_id))
            return
        self.agent.count("grants")
        self.agent.send(
            peer,
            p.Grant(
                msg.request_id, lease.lease_id, self.agent.epoch, sorted(lease.active), self.memory
            ),
        )

    def on_release(self, peer, msg: p.Release) -> None:
        if msg.epoch == self.agent.epoch:
            self._returned(self.ledger.release(peer.agent_id, msg.lease_id, msg.blocks))

    def on_ack(self, peer, msg: p.ReclaimAck) -> None:
        if msg.epoch != self.agent.epoch:
            self.agent.count("stale_acks")
            return
        self._sent_at.pop(msg.reclaim_id, None)
        self._returned(self.ledger.ack(peer.agent_id, msg.reclaim_id, msg.lease_id))

    def drop_borrower(self, agent_id: str) -> None:
        freed = self.ledger.drop_borrower(agent_id)
        self._sent_at = {r: t for r, t in self._sent_at.items() if r in self.ledger.reclaims}
        self._returned(freed)

    # ---- time ----
    def tick(self, now: float) -> None:
        deadline = self.agent.config.reclaim_deadline_s
        for rid, sent in list(self._sent_at.items()):
            rec = self.ledger.reclaims.get(rid)
            if rec is None:
                del self._sent_at[rid]
            elif now - sent > deadline:
                log.warning(
                    "reclaim %d of lease %d from %s unacknowledged after %.2fs; resending",
                    rid,
                    rec.lease_id,
                    rec.borrower,
                    deadline,
                )
                self.agent.count("reclaims_resent")
                self._send_reclaims([rec], resend=True)
        self.maybe_advertise()

    def maybe_advertise(self) -> None:
        lendable = self.ledger.lendable()
        if lendable != self._advertised:
            self._advertised = lendable
            for peer in list(self.agent.peers.values()):
                self.agent.send(peer, p.Advertise(lendable))

    def _send_reclaims(self, reclaims: list[PendingReclaim], resend: bool = False) -> None:
        ms = int(self.agent.config.reclaim_deadline_s * 1000)
        for rec in reclaims:
            peer = self.agent.peers.get(rec.borrower)
            self._sent_at[rec.reclaim_id] = self.agent.now()
            if not resend:
                self.agent.count("reclaims")
            if peer is not None:
                self.agent.send(
                    peer,
                    p.Reclaim(rec.reclaim_id, rec.lease_id, self.agent.epoch, list(rec.blocks), ms),
                )

    def _returned(self, blocks: list[int]) -> None:
        if blocks:
            self.agent.emit(BlocksReturned(tuple(blocks)))
        more = self.ledger.reclaim_for_debt() if self.ledger.owner_debt else []
        self._send_reclaims(more)
