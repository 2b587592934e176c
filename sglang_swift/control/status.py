"""The operator's view of one agent (`ctl status`, `ControlAgent.status()`): its lending state,
its peers (suspect or not, longest silence) and every lease it lends or borrows. Read under the
agent's lock."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from sglang_swift.control import protocol as p

if TYPE_CHECKING:
    from sglang_swift.control.agent import ControlAgent


def agent_status(a: ControlAgent) -> p.AgentStatus:
    now = time.monotonic()
    mem, led = a.donor.memory, a.donor.ledger
    peers = [
        p.PeerStatus(
            q.agent_id,
            q.epoch,
            q.pid,
            q.model,
            int(max(0.0, now - q.last_rx) * 1000),
            q.lendable,
            bool(q.suspect_since),
            q.max_silence_ms,
        )
        for q in a.peers.values()
    ]
    leases = [
        p.LeaseStatus(
            a.config.agent_id,
            ls.borrower,
            a.epoch,
            ls.lease_id,
            ls.size,
            ls.size - len(ls.active),
        )
        for ls in led.leases.values()
    ]
    leases += [
        p.LeaseStatus(
            k.donor,
            a.config.agent_id,
            k.epoch,
            k.lease_id,
            len(h.active) + sum(map(len, h.reclaiming.values())),
            sum(map(len, h.reclaiming.values())),
        )
        for k, h in a.borrower.leases.items()
    ]
    lent = sum(ls.size for ls in led.leases.values())
    return p.AgentStatus(
        a.config.agent_id,
        a.epoch,
        os.getpid(),
        a.model,
        a.endpoint,
        mem.num_blocks if mem else 0,
        led.lendable(),
        led.reserve,
        lent,
        a.borrower.borrowed(),
        peers,
        leases,
        dict(a.counters, send_dropped=a.link.dropped if a.link else 0),
        a.capacity,
    )
