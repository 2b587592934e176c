"""Fuzz: 10,000+ malformed, truncated, oversized, wrong-version, unauthenticated, forged,
stale and unknown-type messages at a live donor, then 2,000 well-formed but nonsensical ones
from an authenticated peer; it must refuse or ignore each one, keep its leases, stay up, and
afterwards still grant and reclaim correct leases."""

from __future__ import annotations

import hashlib
import hmac
import os
import random

import msgspec
import pytest
import zmq

from benchmarks.peers.peer_process import SimGroup
from sglang_swift.control import protocol as p
from sglang_swift.control.auth import read_secret
from sglang_swift.control.discovery import read_records

pytestmark = pytest.mark.integration

N_MESSAGES = 10_000


def _signed(secret: bytes, body: bytes, version: int = p.PROTOCOL_VERSION) -> bytes:
    header = p.MAGIC + version.to_bytes(2, "big") + bytes(2)
    return header + hmac.new(secret, header + body, hashlib.sha256).digest() + body


def _raw(sender: str, epoch: int, to_epoch: int, seq: int, body: dict) -> bytes:
    return msgspec.msgpack.encode(
        {"sender": sender, "epoch": epoch, "to_epoch": to_epoch, "seq": seq, "body": body}
    )


def _bad_messages(rng: random.Random, secret: bytes, donor_epoch: int, borrower_epoch: int):
    """Yield (kind, frames) forever, cycling through the ways a message can be wrong."""
    codec = p.Codec(secret)
    good = codec.encode(
        p.Envelope("borrower", borrower_epoch, donor_epoch, 1, p.LeaseRequest(1, 4))
    )
    makers = [
        lambda: ("random", [rng.randbytes(rng.randint(0, 200))]),
        lambda: ("truncated", [good[: rng.randint(0, len(good) - 1)]]),
        lambda: ("magic", [b"XXXX" + good[4:]]),
        lambda: ("version", [_signed(secret, good[p.OVERHEAD :], version=rng.randint(2, 65535))]),
        lambda: ("auth", [good[:10] + bytes([good[10] ^ 1]) + good[11:]]),
        lambda: (
            "auth",
            [
                p.Codec(b"w" * 32).encode(
                    p.Envelope(
                        "borrower",
                        borrower_epoch,
                        donor_epoch,
                        10**9,
                        p.Release(1, donor_epoch, [0]),
                    )
                )
            ],
        ),
        lambda: ("msgpack", [_signed(secret, rng.randbytes(rng.randint(1, 64)))]),
        lambda: (
            "unknown_type",
            [
                _signed(
                    secret,
                    _raw(
                        "borrower",
                        borrower_epoch,
                        donor_epoch,
                        1,
                        {"t": f"cmd{rng.randint(0, 99)}"},
                    ),
                )
            ],
        ),
        lambda: (
            "values",
            [
                _signed(
                    secret,
                    _raw(
                        "borrower",
                        borrower_epoch,
                        donor_epoch,
                        1,
                        {"t": "lease_request", "request_id": -1, "num_blocks": 1 << 40},
                    ),
                )
            ],
        ),
        lambda: (
            "values",
            [
                _signed(
                    secret,
                    _raw(
                        "borrower",
                        borrower_epoch,
                        donor_epoch,
                        1,
                        {
                            "t": "release",
                            "lease_id": 1,
                            "epoch": donor_epoch,
                            "blocks": [rng.randint(-5, -1)],
                        },
                    ),
                )
            ],
        ),
        lambda: (
            "fields",
            [
                _signed(
                    secret,
                    _raw(
                        "borrower",
                        borrower_epoch,
                        donor_epoch,
                        1,
                        {"t": "reclaim_ack", "reclaim_id": "x"},
                    ),
                )
            ],
        ),
        lambda: ("frames", [good, good]),
        lambda: (
            "ghost",
            [codec.encode(p.Envelope("ghost", 1, donor_epoch, 1, p.LeaseRequest(1, 4)))],
        ),
        lambda: (
            "stale",
            [
                codec.encode(
                    p.Envelope(
                        "borrower",
                        borrower_epoch - 1,
                        donor_epoch,
                        10**9,
                        p.Release(1, donor_epoch, [0, 1]),
                    )
                )
            ],
        ),
        lambda: (
            "replay",
            [
                codec.encode(
                    p.Envelope(
                        "borrower",
                        borrower_epoch,
                        donor_epoch,
                        0,
                        p.Release(1, donor_epoch, [0, 1]),
                    )
                )
            ],
        ),
        lambda: (
            "hello_version",
            [
                codec.encode(
                    p.Envelope(
                        "borrower", borrower_epoch + 1, 0, 1, p.Hello(99, "m", "ipc:///x", 1)
                    )
                )
            ],
        ),
        lambda: ("empty", [b""]),
    ]
    while True:
        yield rng.choice(makers)()


def _authenticated_nonsense(rng: random.Random, secret: bytes, donor_epoch: int, n: int):
    """A peer holding the secret that joins properly, then sends well-formed nonsense:
    wrong geometry, foreign lease ids and blocks, unsolicited grants and reclaims."""
    codec = p.Codec(secret)
    mem = p.MemoryDescriptor("shm", b"nope", "cpu", 1 << 20, 1 << 20, 1, 1, "x",
                             p.PoolLayoutMsg(1, 4096, 4096, 1, 64, 64, "float16", 1, 0))
    r = lambda: rng.randint(0, 64)  # noqa: E731
    blocks = lambda: [rng.randint(0, 1 << 20) for _ in range(rng.randint(0, 8))]  # noqa: E731
    makers = [
        lambda: p.LeaseRequest(
            r(), rng.randint(1, 1 << 16), rng.randint(0, 100), rng.choice([1, 255, 10**9])
        ),
        lambda: p.Release(r(), rng.choice([donor_epoch, r()]), blocks()),
        lambda: p.ReclaimAck(r(), r(), rng.choice([donor_epoch, r()]), blocks()),
        lambda: p.Grant(r(), r(), r(), blocks(), mem),
        lambda: p.Reclaim(r(), r(), r(), blocks(), r()),
        lambda: p.Advertise(rng.randint(0, 1 << 40)),
        lambda: p.Heartbeat(rng.randint(0, 1 << 62), rng.randint(0, 1 << 62), r()),
        lambda: p.Error(rng.choice([p.E_INVALID, p.E_NO_CAPACITY, "zzz"]), "fuzz", r()),
        lambda: p.StatusRequest(),
    ]
    hello = p.Hello(
        p.PROTOCOL_VERSION, "fuzz", "ipc:///nonexistent/fuzzer.sock", os.getpid(), 256, 4, "cpu"
    )
    yield codec.encode(p.Envelope("fuzzer", 7, donor_epoch, 1, hello))
    for seq in range(2, n + 2):
        yield codec.encode(p.Envelope("fuzzer", 7, donor_epoch, seq, rng.choice(makers)()))


def test_ten_thousand_bad_messages_change_nothing():
    """After the flood the donor still runs, its lease is intact, it refused every message,
    and it grants and reclaims correctly."""
    sims = SimGroup()
    ctx = zmq.Context()
    try:
        donor = sims.start("donor", "--donate", "64")
        borrower = sims.start("borrower", "--auto-ack")
        borrower.status_until(lambda st: any(q["lendable"] for q in st["peers"]))
        borrower.send("request", n=16, donor="donor")
        key = borrower.wait_for(lambda e: e["ev"] == "LeaseGranted", 10)["key"]
        before = donor.status()
        assert before["lent"] == 16

        secret = read_secret(os.path.join(sims.rdv, "secret"))
        endpoint = {r.agent_id: r.endpoint for r in read_records(sims.rdv)}["donor"]
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        kinds: dict[str, int] = {}
        gen = _bad_messages(random.Random(4), secret, donor.epoch, borrower.epoch)
        for _ in range(N_MESSAGES):
            kind, frames = next(gen)
            kinds[kind] = kinds.get(kind, 0) + 1
            sock.send_multipart(frames)
        big = ctx.socket(zmq.DEALER)  # oversized: libzmq drops the connection, not the agent
        big.setsockopt(zmq.LINGER, 0)
        big.connect(endpoint)
        for _ in range(5):
            big.send(_signed(secret, bytes(2 << 20)))
        assert len(kinds) >= 15
        for frame in _authenticated_nonsense(random.Random(5), secret, donor.epoch, 2000):
            sock.send(frame)

        after = donor.status_until(
            lambda st: (
                st["counters"].get("msgs_in", 0) - before["counters"].get("msgs_in", 0)
                >= N_MESSAGES + 2000
            ),
            60,
        )
        c = after["counters"]
        assert c.get("handler_errors", 0) == 0, c
        refused = sum(v for k, v in c.items() if k.startswith(("bad_", "refused_")))
        refused += c.get("stale", 0) + c.get("replayed", 0)
        assert refused >= N_MESSAGES, c
        assert after["lent"] == 16 and after["epoch"] == before["epoch"]
        assert {q["agent_id"] for q in after["peers"]} <= {"borrower", "fuzzer"}
        assert sock.poll(5000), "refusals are answered with Error"
        reply = p.Codec(secret).decode(sock.recv())
        assert isinstance(reply.body, p.Error)

        # Still serving correct leases: a new grant, a reclaim round trip, a release.
        start = len(borrower.events)
        borrower.send("request", n=48, donor="donor")
        grant = borrower.wait_for(lambda e: e["ev"] == "LeaseGranted", 10, start)
        donor.status_until(lambda st: st["lent"] == 64)
        assert not set(grant["blocks"]) & set(
            next(e for e in borrower.events if e["ev"] == "LeaseGranted")["blocks"]
        )
        donor.send("demand", n=8)
        assert len(donor.wait_for(lambda e: e["ev"] == "BlocksReturned", 10)["blocks"]) == 8
        borrower.send("release_all")
        donor.status_until(lambda st: st["lent"] == 0)
        assert key[1] == donor.epoch
        for proc in (donor, borrower):
            assert proc.ask("integrity", "integrity")["ok"] and not proc.violations()
        sock.close()
        big.close()
    finally:
        ctx.destroy(linger=0)
        sims.close()
