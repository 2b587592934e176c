"""Wire format of the control channel: every message round-trips; anything else is refused
with BadMessage (and only BadMessage), whatever the bytes."""

from __future__ import annotations

import hashlib
import hmac

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_swift.control import protocol as p

SECRET = b"s" * 32
LAYOUT = p.PoolLayoutMsg(1, 16, 16, 1, 64, 64, "float16", 1, 0)  # 16 pages of 256 bytes
MEM = p.MemoryDescriptor("shm", b"arena", "cpu", 4096, 4096, 1, 123, "donor:1", LAYOUT)

SAMPLES = [
    p.Hello(p.PROTOCOL_VERSION, "llama", "ipc:///tmp/x.sock", 42, 256, 16, "cuda:0", True),
    p.Hello(p.PROTOCOL_VERSION, "l", "tcp://127.0.0.1:5", 42, host="boot/4026531836", pid_start=9),
    p.Advertise(12),
    p.LeaseRequest(7, 4, 2, 256),
    p.Grant(7, 1, 99, [0, 1, 2], MEM),
    p.Reclaim(3, 1, 99, [2], 500),
    p.ReclaimAck(3, 1, 99, [2]),
    p.Release(1, 99, [0, 1]),
    p.Heartbeat(10**12, 10**12 - 5, 3),
    p.Revalidate(4, 10**12, [1, 2, 3]),
    p.Revalidated(4, 10**12, [1, 3], [2]),
    p.Error(p.E_NO_CAPACITY, "full", 7),
    p.Bye(),
    p.StatusRequest(),
]


def _header(version: int = p.PROTOCOL_VERSION) -> bytes:
    return p.MAGIC + version.to_bytes(2, "big") + bytes(2)


def _signed(body: bytes, version: int = p.PROTOCOL_VERSION) -> bytes:
    header = _header(version)
    return header + hmac.new(SECRET, header + body, hashlib.sha256).digest() + body


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    """encode then decode gives back the same envelope, for every message type."""
    codec = p.Codec(SECRET)
    env = p.Envelope("agent-a", 5, 6, 7, msg)
    assert codec.decode(codec.encode(env)) == env


def test_memory_descriptor_is_a_pool_region_with_its_layout():
    """Invariant: the data plane's export plus the pool's layout is exactly the descriptor
    (a dict round-trips); block ids are the pool's pages; a region whose size fields overflow,
    an unknown kind, or a descriptor without a layout is refused."""
    d = dict(
        kind="cuda_ipc",
        handle=b"\x01" * 64,
        device="cuda:1",
        total_bytes=1 << 20,
        block_bytes=1 << 20,
        num_blocks=1,
        owner_pid=1,
        owner_uuid="x",
        layout=msgspec.structs.asdict(LAYOUT),
    )
    desc = p.MemoryDescriptor.coerce(d)
    assert desc.to_dict() == d and desc.num_ids == 16
    with pytest.raises(ValueError):
        p.MemoryDescriptor.coerce(dict(d, num_blocks=2))  # overflows total_bytes
    with pytest.raises(msgspec.ValidationError):
        p.MemoryDescriptor.coerce(dict(d, kind="nvlink"))
    with pytest.raises(msgspec.ValidationError, match="layout"):
        p.MemoryDescriptor.coerce({k: v for k, v in d.items() if k != "layout"})


@pytest.mark.parametrize(
    "frame,code",
    [
        (b"", p.E_TRUNCATED),
        (b"SWCC\x00\x01\x00\x00" + b"\x00" * 10, p.E_TRUNCATED),
        (b"XXXX" + bytes(60), p.E_MAGIC),
        (_signed(b"\x80", version=p.PROTOCOL_VERSION + 1), p.E_VERSION),
        (_signed(b"\x80", version=p.PROTOCOL_VERSION - 1), p.E_VERSION),
        (_header() + bytes(32) + b"\x80", p.E_AUTH),
        (_signed(b"\xc1"), p.E_MALFORMED),
        (
            _signed(
                msgspec.msgpack.encode(
                    {
                        "sender": "a",
                        "epoch": 1,
                        "to_epoch": 0,
                        "seq": 1,
                        "body": {"t": "launch_missiles"},
                    }
                )
            ),
            p.E_UNKNOWN_TYPE,
        ),
        (
            _signed(
                msgspec.msgpack.encode(
                    {
                        "sender": "a",
                        "epoch": 1,
                        "to_epoch": 0,
                        "seq": 1,
                        "body": {"t": "lease_request", "request_id": 1, "num_blocks": -3},
                    }
                )
            ),
            p.E_MALFORMED,
        ),
        (
            _signed(
                msgspec.msgpack.encode(
                    {"sender": "a", "epoch": -1, "to_epoch": 0, "seq": 1, "body": {"t": "bye"}}
                )
            ),
            p.E_MALFORMED,
        ),
    ],
)
def test_bad_frames_are_refused_with_their_reason(frame, code):
    """Truncated, foreign, wrong-version, unauthenticated, malformed and unknown frames."""
    with pytest.raises(p.BadMessage) as info:
        p.Codec(SECRET).decode(frame)
    assert info.value.code == code


def test_oversized_frames_are_refused_before_parsing():
    """A frame above the size limit is refused without looking inside."""
    codec = p.Codec(SECRET, max_bytes=4096)
    big = codec.encode(p.Envelope("a", 1, 0, 1, p.Release(1, 1, list(range(3000)))))
    with pytest.raises(p.BadMessage) as info:
        codec.decode(big)
    assert info.value.code == p.E_TOO_BIG


def test_a_different_secret_cannot_speak():
    """Frames signed with another node's secret fail authentication."""
    frame = p.Codec(b"o" * 32).encode(p.Envelope("intruder", 1, 0, 1, p.StatusRequest()))
    with pytest.raises(p.BadMessage) as info:
        p.Codec(SECRET).decode(frame)
    assert info.value.code == p.E_AUTH


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_bad_message(data):
    """No input crashes the decoder with anything but BadMessage."""
    codec = p.Codec(SECRET)
    for frame in (data, _signed(data), p.MAGIC + data):
        try:
            codec.decode(frame)
        except p.BadMessage:
            pass


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([type(m).__name__ for m in SAMPLES]), _json)
def test_signed_garbage_of_known_types_is_refused_or_valid(kind, junk):
    """Authenticated but nonsensical fields are refused by schema, never accepted half-way."""
    tag = msgspec.inspect.type_info(getattr(p, kind)).tag
    body = {"t": tag, **(junk if isinstance(junk, dict) else {"x": junk})}
    raw = msgspec.msgpack.encode({"sender": "a", "epoch": 1, "to_epoch": 0, "seq": 1, "body": body})
    try:
        env = p.Codec(SECRET).decode(_signed(raw))
    except p.BadMessage:
        return
    assert type(env.body).__name__ == kind
