"""Every message of the donation control channel, and its wire format.

One frame per message: ``MAGIC (4) | wire version (u16) | flags (u16) | HMAC-SHA256 (32) | body``.
The body is a msgpack-encoded :class:`Envelope` whose ``body`` is one of the tagged message
structs below (tag field ``t``). The HMAC covers header and body, keyed by the node secret, so
only processes that can read the secret file can speak on the channel. No pickle anywhere.

Decoding never raises anything but :class:`BadMessage`, whose ``code`` says why the frame was
refused; callers log it, maybe answer with :class:`Error`, and leave their state untouched.
Value ranges and list lengths are enforced at decode time by msgspec constraints.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Annotated

import msgspec

# 2: liveness by process checks and lease re-validation (Revalidate); a version-1 agent would
# declare a live borrower dead after one heartbeat timeout, so the two must not mix.
PROTOCOL_VERSION = 2
MAGIC = b"SWCC"
_HEADER = struct.Struct(">4sHH")
MAC_BYTES = 32
OVERHEAD = _HEADER.size + MAC_BYTES
MAX_BLOCKS_PER_MESSAGE = 1 << 16

U64 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Blocks = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]],
    msgspec.Meta(max_length=MAX_BLOCKS_PER_MESSAGE),
]
LeaseIds = Annotated[list[U64], msgspec.Meta(max_length=4096)]


class PoolLayoutMsg(msgspec.Struct, frozen=True):
    """Byte layout of a donor's KV pool region (`dataplane.pool_layout.PoolLayout`): a lease's
    blocks are pages of that pool; the borrower computes every address from these numbers."""

    num_layers: U64
    rows: U64
    padded_rows: U64
    head_num: U64
    head_dim: U64
    v_head_dim: U64
    dtype: Name
    page_size: U64
    data_offset: U64


class MemoryDescriptor(msgspec.Struct, frozen=True):
    """The donor memory a grant's blocks live in; the data plane exports it as a dict. A
    SwiftCache server lends its own KV pool: `layout` says how, and block ids are its page ids;
    with `ranks`, the pools of a TP donor's ranks (docs/integration.md "Tensor parallelism").
    `total_bytes`, `block_bytes` and `num_blocks` are the region's size as its header states it
    (one block of the whole region)."""

    kind: Annotated[str, msgspec.Meta(pattern="^(shm|cuda_ipc)$")]
    handle: Annotated[bytes, msgspec.Meta(max_length=4096)]
    device: Name
    total_bytes: U64
    block_bytes: U64
    num_blocks: U64
    owner_pid: U64
    owner_uuid: Name
    layout: PoolLayoutMsg
    # A TP donor's pool is one region per rank, each lending the same page ids: every rank's
    # descriptor (with its layout), rank 0's first. Empty: the one region above.
    ranks: Annotated[list[MemoryDescriptor], msgspec.Meta(max_length=64)] = []

    @classmethod
    def coerce(cls, value: MemoryDescriptor | dict) -> MemoryDescriptor:
        """Accept an exported dict (exactly the field names above) or a descriptor."""
        desc = value if isinstance(value, cls) else msgspec.convert(value, cls)
        if desc.block_bytes * desc.num_blocks > desc.total_bytes:
            raise ValueError(f"descriptor blocks overflow its memory: {desc}")
        return desc

    @property
    def num_ids(self) -> int:
        """How many block ids a grant may name: the pool's pages."""
        return self.layout.padded_rows // self.layout.page_size

    def to_dict(self) -> dict:
        """Plain values only (the layout as a dict)."""
        out = msgspec.structs.asdict(self)
        out["layout"] = msgspec.structs.asdict(self.layout)
        if self.ranks:
            out["ranks"] = [r.to_dict() for r in self.ranks]
        else:
            del out["ranks"]
        return out


class _Msg(msgspec.Struct, frozen=True, tag_field="t"):
    pass


Endpoint = Annotated[str, msgspec.Meta(pattern=r"^(ipc://|tcp://)[^\s]+$", max_length=256)]


class Hello(_Msg, tag="hello"):
    """Join or rejoin: who I am and what I can lend. ``reply`` asks the receiver to answer.
    ``host`` (boot id and pid namespace, `common.process.host_identity`) and ``pid_start`` let
    a peer on the same host tell from ``pid`` alone whether this process is gone."""

    protocol_version: U64
    model: Name
    endpoint: Endpoint
    pid: U64
    block_bytes: U64 = 0
    num_blocks: U64 = 0
    device: Name = ""
    reply: bool = False
    host: Name = ""
    pid_start: U64 = 0
    # The layout of the pool this peer lends (its own KV pool), so a borrower sizes its first
    # request in that pool's pages; None when it lends no pool.
    layout: PoolLayoutMsg | None = None


class Advertise(_Msg, tag="advertise"):
    """Blocks the donor can lend right now (after its reserve)."""

    lendable: U64


class LeaseRequest(_Msg, tag="lease_request"):
    request_id: U64
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS_PER_MESSAGE)]
    priority: Annotated[int, msgspec.Meta(ge=0, le=100)] = 0
    block_bytes: U64 = 0


class Grant(_Msg, tag="grant"):
    """A lease: ``blocks`` of ``memory`` for the borrower until reclaimed or released."""

    request_id: U64
    lease_id: U64
    epoch: U64
    blocks: Blocks
    memory: MemoryDescriptor


class Reclaim(_Msg, tag="reclaim"):
    """Stop reading ``blocks`` of the lease, then acknowledge; the donor waits for the ack."""

    reclaim_id: U64
    lease_id: U64
    epoch: U64
    blocks: Blocks
    deadline_ms: U64


class ReclaimAck(_Msg, tag="reclaim_ack"):
    reclaim_id: U64
    lease_id: U64
    epoch: U64
    blocks: Blocks


class Release(_Msg, tag="release"):
    """The borrower gives blocks back on its own; it stopped reading them before sending."""

    lease_id: U64
    epoch: U64
    blocks: Blocks


class Heartbeat(_Msg, tag="heartbeat"):
    """``sent_ns`` is the sender's CLOCK_MONOTONIC; ``echo_ns`` returns the peer's last one."""

    sent_ns: U64
    echo_ns: U64
    lendable: U64 = 0


class Revalidate(_Msg, tag="revalidate"):
    """Borrower to donor: are these leases still granted to me (this epoch)? Sent when their
    read deadline passed while the donor was not known to be gone; ``sent_ns`` is the
    borrower's CLOCK_MONOTONIC at sending, echoed in the answer."""

    probe_id: U64
    sent_ns: U64
    lease_ids: LeaseIds


class Revalidated(_Msg, tag="revalidated"):
    """Donor's answer: of the asked leases, ``valid`` are still the borrower's (it may read
    them until ``echo_ns`` plus its read validity); ``invalid`` are gone (never read again)."""

    probe_id: U64
    echo_ns: U64
    valid: LeaseIds
    invalid: LeaseIds


class Error(_Msg, tag="error"):
    code: Name
    detail: Text = ""
    ref: U64 = 0


class Bye(_Msg, tag="bye"):
    """Clean leave: the sender's leases are void (it has stopped reading and lending)."""


class StatusRequest(_Msg, tag="status_request"):
    pass


class LeaseStatus(msgspec.Struct, frozen=True):
    donor: Name
    borrower: Name
    epoch: U64
    lease_id: U64
    num_blocks: U64
    reclaiming: U64


class PeerStatus(msgspec.Struct, frozen=True):
    agent_id: Name
    epoch: U64
    pid: U64
    model: Name
    last_seen_ms: U64
    lendable: U64
    suspect: bool = False  # silent past the heartbeat timeout, its process not known gone
    max_silence_ms: U64 = 0  # the longest gap between two messages from it so far


class CapacityStatus(msgspec.Struct, frozen=True):
    """The owning server's KV capacity in its own tokens (what `ctl status` shows per server):
    its pool, what it lent out of it, what it borrows, and what it can use itself now."""

    kv_pool_tokens: U64
    lent_tokens: U64
    borrowed_tokens: U64
    usable_tokens: U64
    # where the tree keeps cached tokens below the device now, and what was admitted from
    # each lower tier so far (an older peer sends none of these: 0)
    donor_tier_tokens: U64 = 0
    host_tier_tokens: U64 = 0
    host_capacity_tokens: U64 = 0
    donor_hit_tokens: U64 = 0
    host_hit_tokens: U64 = 0


class AgentStatus(msgspec.Struct, frozen=True):
    agent_id: Name
    epoch: U64
    pid: U64
    model: Name
    endpoint: Name
    num_blocks: U64
    lendable: U64
    reserve: U64
    lent: U64
    borrowed: U64
    peers: list[PeerStatus]
    leases: list[LeaseStatus]
    counters: dict[str, int]
    capacity: CapacityStatus | None = None  # None: the owner never reported (a bare agent)


class StatusReply(_Msg, tag="status_reply"):
    status: AgentStatus


Message = (
    Hello
    | Advertise
    | LeaseRequest
    | Grant
    | Reclaim
    | ReclaimAck
    | Release
    | Heartbeat
    | Revalidate
    | Revalidated
    | Error
    | Bye
    | StatusRequest
    | StatusReply
)


class Envelope(msgspec.Struct, frozen=True):
    """Sender identity and ordering: ``to_epoch`` 0 means "I don't know your epoch yet"."""

    sender: Name
    epoch: U64
    to_epoch: U64
    seq: U64
    body: Message


class BadMessage(Exception):
    """A frame refused by :func:`decode`; ``code`` is one of the Error codes below."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code, self.detail = code, detail


# Error codes, sent in Error.code and used as BadMessage.code.
E_TOO_BIG, E_TRUNCATED, E_MAGIC, E_VERSION = "too_big", "truncated", "bad_magic", "version"
E_AUTH, E_MALFORMED, E_UNKNOWN_TYPE = "auth", "malformed", "unknown_type"
E_UNKNOWN_PEER, E_STALE, E_INVALID = "unknown_peer", "stale", "invalid"
E_NO_CAPACITY, E_NOT_DONOR = "no_capacity", "not_donor"


class Codec:
    """Signs and verifies frames with the node secret; one per agent, used from one thread."""

    def __init__(self, secret: bytes, max_bytes: int = 1 << 20) -> None:
        self._secret = secret
        self.max_bytes = max_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Envelope)
        self._header = _HEADER.pack(MAGIC, PROTOCOL_VERSION, 0)

    def encode(self, env: Envelope) -> bytes:
        body = self._encoder.encode(env)
        mac = hmac.new(self._secret, self._header + body, hashlib.sha256).digest()
        return self._header + mac + body

    def decode(self, frame: bytes) -> Envelope:
        if len(frame) > self.max_bytes:
            raise BadMessage(E_TOO_BIG, f"{len(frame)} bytes > limit {self.max_bytes}")
        if len(frame) < OVERHEAD + 1:
            raise BadMessage(E_TRUNCATED, f"{len(frame)} bytes")
        magic, version, _flags = _HEADER.unpack_from(frame)
        if magic != MAGIC:
            raise BadMessage(E_MAGIC, repr(magic))
        if version != PROTOCOL_VERSION:
            raise BadMessage(
                E_VERSION, f"wire version {version}; this agent speaks {PROTOCOL_VERSION}"
            )
        header, mac, body = frame[: _HEADER.size], frame[_HEADER.size : OVERHEAD], frame[OVERHEAD:]
        want = hmac.new(self._secret, header + body, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, want):
            raise BadMessage(E_AUTH, "HMAC mismatch: sender lacks the node secret")
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as exc:
            code = E_UNKNOWN_TYPE if "`$.body.t`" in str(exc) else E_MALFORMED
            raise BadMessage(code, str(exc)[:200]) from None
        except msgspec.DecodeError as exc:
            raise BadMessage(E_MALFORMED, str(exc)[:200]) from None
