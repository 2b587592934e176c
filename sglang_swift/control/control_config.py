"""ControlConfig: every setting of the donation control channel, validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


class ControlConfigError(ValueError):
    """Misconfiguration found at start-up; the message says how to fix it."""


def default_rendezvous_dir() -> str:
    """Per-user directory on the node where agents publish their endpoints (created 0700)."""
    return os.path.join("/tmp", f"sglang_swift-{os.getuid()}", "control")


@dataclass(frozen=True)
class ControlConfig:
    """Settings of one agent. Times are seconds; block counts are in the donor's arena blocks.

    Liveness (docs/liveness.md has the reasoning and the measurements behind the defaults):
    ``heartbeat_timeout_s`` of silence makes a peer *suspect*: if it is on this host and its
    process is gone it is declared dead at once; otherwise its leases stand. Only
    ``unresponsive_timeout_s`` of silence (0: ``max(20, 10 * heartbeat_timeout_s)``, see
    ``dead_after_s``) declares a live-looking peer dead. A borrower reads a lease's blocks only
    until ``dead_after_s - lease_margin_s`` after the donor last vouched for it
    (``read_validity_s``), so a donor that declares it dead can reuse its blocks at once; past
    that deadline the borrower re-validates the lease with the donor instead of dropping it.
    """

    agent_id: str
    rendezvous_dir: str = field(default_factory=default_rendezvous_dir)
    secret_file: str = ""  # "" means <rendezvous_dir>/secret
    peers: tuple[str, ...] = ()  # static peer endpoints, in addition to the rendezvous directory
    transport: str = "ipc"  # "ipc" or "tcp"
    tcp_host: str = "127.0.0.1"
    tcp_port: int = 0  # 0 picks a free port
    heartbeat_interval_s: float = 0.2
    heartbeat_timeout_s: float = 1.0
    unresponsive_timeout_s: float = 0.0  # 0: derived, see dead_after_s
    lease_margin_s: float = 0.5
    discovery_interval_s: float = 0.25
    request_timeout_s: float = 2.0
    reclaim_deadline_s: float = 0.5
    reserve_blocks: int = 0
    low_watermark_blocks: int = 0
    policy: str = "proportional"
    max_blocks_per_borrower: int = 0  # 0 means no cap
    max_message_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.agent_id or len(self.agent_id) > 128 or "/" in self.agent_id:
            raise ControlConfigError(f"agent_id {self.agent_id!r}: give 1-128 chars without '/'")
        if self.transport not in ("ipc", "tcp"):
            raise ControlConfigError(f"transport {self.transport!r}: use 'ipc' or 'tcp'")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ControlConfigError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if self.unresponsive_timeout_s and self.unresponsive_timeout_s <= self.heartbeat_timeout_s:
            raise ControlConfigError(
                f"unresponsive_timeout_s ({self.unresponsive_timeout_s}) must exceed "
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}), or be 0 to derive it"
            )
        if not 0 < self.lease_margin_s < self.dead_after_s - self.heartbeat_timeout_s:
            raise ControlConfigError(
                f"lease_margin_s ({self.lease_margin_s}) must be > 0 and leave a read validity "
                f"({self.dead_after_s} - margin) longer than heartbeat_timeout_s "
                f"({self.heartbeat_timeout_s}); lower the margin or raise unresponsive_timeout_s"
            )
        if min(self.reserve_blocks, self.low_watermark_blocks, self.max_blocks_per_borrower) < 0:
            raise ControlConfigError("block counts must be >= 0")
        if self.max_message_bytes < 4096:
            raise ControlConfigError("max_message_bytes must be at least 4096")

    @property
    def dead_after_s(self) -> float:
        """Silence after which a peer whose process we cannot see gone is declared dead."""
        return self.unresponsive_timeout_s or max(20.0, 10 * self.heartbeat_timeout_s)

    @property
    def read_validity_s(self) -> float:
        """How long after the donor last vouched for a lease the borrower may read it."""
        return self.dead_after_s - self.lease_margin_s

    @property
    def secret_path(self) -> str:
        return self.secret_file or os.path.join(self.rendezvous_dir, "secret")
