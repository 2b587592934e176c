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

    ``heartbeat_timeout_s`` is when a silent peer is declared dead. A borrower stops reading a
    donor's blocks ``lease_margin_s`` earlier than that (see ``BorrowerSide``), so a donor that
    declares a borrower dead can reuse its blocks at once.
    """

    agent_id: str
    rendezvous_dir: str = field(default_factory=default_rendezvous_dir)
    secret_file: str = ""  # "" means <rendezvous_dir>/secret
    peers: tuple[str, ...] = ()  # static peer endpoints, in addition to the rendezvous directory
    transport: str = "ipc"  # "ipc" or "tcp"
    tcp_host: str = "127.0.0.1"
    tcp_port: int = 0  # 0 picks a free port
    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 1.0
    lease_margin_s: float = 0.25
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
        if not 0 < self.lease_margin_s < self.heartbeat_timeout_s:
            raise ControlConfigError("need 0 < lease_margin_s < heartbeat_timeout_s")
        if min(self.reserve_blocks, self.low_watermark_blocks, self.max_blocks_per_borrower) < 0:
            raise ControlConfigError("block counts must be >= 0")
        if self.max_message_bytes < 4096:
            raise ControlConfigError("max_message_bytes must be at least 4096")

    @property
    def secret_path(self) -> str:
        return self.secret_file or os.path.join(self.rendezvous_dir, "secret")
