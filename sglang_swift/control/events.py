"""What the agent tells its owner (queued; the owner drains them from its own loop)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from sglang_swift.control.protocol import MemoryDescriptor


class LeaseKey(NamedTuple):
    """A lease is named by its donor, the donor's epoch and the donor-assigned lease id."""

    donor: str
    epoch: int
    lease_id: int


@dataclass(frozen=True)
class LeaseGranted:
    """Borrower: ``blocks`` of ``memory`` are yours to read and write until reclaimed/lost."""

    request_id: int
    key: LeaseKey
    blocks: tuple[int, ...]
    memory: MemoryDescriptor


@dataclass(frozen=True)
class RequestFailed:
    """Borrower: a lease request got nothing (``reason``: no_donor, no_capacity, timeout, ...)."""

    request_id: int
    donor: str
    reason: str


@dataclass(frozen=True)
class ReclaimRequested:
    """Borrower: stop reading ``blocks``, then call ``agent.ack_reclaim(event)``. ``deadline`` is
    CLOCK_MONOTONIC seconds; the donor waits past it, but its owner is then short of memory.
    With ``agent.on_reclaim(handler)`` it reaches the handler on the agent's thread first."""

    key: LeaseKey
    reclaim_id: int
    blocks: tuple[int, ...]
    deadline: float


@dataclass(frozen=True)
class LeaseLost:
    """Borrower: the lease is over and its blocks are gone (no ack needed); never read them
    again. ``reason``: the donor's process is gone (``heartbeat timeout``, ``connection
    closed``), it ``restarted`` or ``left``, was ``unresponsive`` for ``dead_after_s``, or it
    dropped the lease (``dropped by the donor``, ``donor forgot us``). Whenever the donor may
    still be running, this lease's read deadline had passed before this was queued. A pause,
    even past the read deadline, is not a loss: the lease is re-validated (docs/liveness.md)."""

    key: LeaseKey
    blocks: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class BlocksReturned:
    """Donor: these blocks are back in the owner's hands and safe to reuse now."""

    blocks: tuple[int, ...]


@dataclass(frozen=True)
class PeerChanged:
    """A peer joined (``joined``) or was lost (``reason``: heartbeat timeout, connection
    closed, unresponsive, restarted, left), at CLOCK_MONOTONIC time ``at``."""

    agent_id: str
    epoch: int
    joined: bool
    reason: str = ""
    at: float = field(default_factory=time.monotonic)


Event = LeaseGranted | RequestFailed | ReclaimRequested | LeaseLost | BlocksReturned | PeerChanged
