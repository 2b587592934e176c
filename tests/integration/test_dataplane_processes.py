"""The data plane across two real processes on CPU (POSIX shared memory).

- Round trip: a donor process holds a pool of the borrower's shape in shared memory and lends
  some of its pages; a borrower process maps it, stores a prefix into the lease's blocks and
  loads it back layer by layer: bit-identical, and the donor sees the bytes.
- Abort: the donor process is killed while the borrower is loading; the borrower's waits end
  within its timeout and name the failed layers.
- Pool lease: a donor process holds its own SGLang-shaped KV pool in shared memory and lends
  some of its pages; a borrower of another shape (layers, heads, dims, dtype, page size) maps
  the pool from the descriptor and its layout, stores into the lent pages and loads back
  bit-identical; the donor sees the bytes in its own buffers and its other pages untouched.

Run as a script, this file is the donor or the borrower (JSON lines on stdin/stdout).
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

GEOMETRY = {
    "num_layers": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "v_head_dim": 16,
    "dtype": "bfloat16",
    "page_size": 8,
}
N_TOKENS = 45  # 5 full pages and a partial sixth
TIMEOUT_S = 20.0
# the pool-lease pair: the donor's pool page and the borrower's (every field differs)
POOL_DONOR = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8, "v_head_dim": 8,
              "dtype": "float16", "page_size": 4}
POOL_BORROWER = {"num_layers": 5, "num_kv_heads": 1, "head_dim": 16, "v_head_dim": 16,
                 "dtype": "bfloat16", "page_size": 8}
POOL_PAGES = 40  # the donor's pool; it lends the odd pages from 7 on


# ---- child roles -------------------------------------------------------------------------------
def _say(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _hear() -> dict:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("parent closed stdin")
    return json.loads(line)


def _digest(region) -> str:
    return hashlib.sha256(region.numpy().tobytes()).hexdigest()


def _pool_region(g, pages: int):
    """A pool of `pages` pages of `g` in a shared region, as a lending server holds its own:
    (region, layout)."""
    from sglang_swift.dataplane import BLOCK_ALIGN_BYTES, PoolLayout, SharedArena

    rows = pages * g.page_size
    layout = PoolLayout(g, rows, rows)
    return SharedArena(-(-layout.data_bytes // BLOCK_ALIGN_BYTES) * BLOCK_ALIGN_BYTES), layout


def donor_main() -> None:
    from sglang_swift.control.ledger import DonorLedger
    from sglang_swift.dataplane import KVGeometry

    g = KVGeometry.from_dict(GEOMETRY)
    arena, layout = _pool_region(g, 16)
    book = DonorLedger()  # the donor's book, as its agent keeps it live
    book.offer(range(layout.num_pages))
    try:
        pages = sorted(book.grant("borrower", 1, -(-N_TOKENS // g.page_size), 0).active)
        book.check_integrity()
        desc = arena.export()
        _say({"desc": {**desc, "handle": desc["handle"].hex(), "layout": layout.to_dict()},
              "blocks": pages})
        while True:
            msg = _hear()
            if msg["cmd"] == "digest":
                _say({"digest": _digest(arena.memory.view(-1))})
            elif msg["cmd"] == "exit":
                break
    finally:
        arena.close()


def _pool_stream(k_bufs, v_bufs, page_size, pages) -> bytes:
    """The lease's byte stream read through SGLang-shaped buffers: for each lent page in grant
    order, each layer's K rows then V rows of that page (the packing rule in its own words)."""
    import torch

    return b"".join(buf[p * page_size:(p + 1) * page_size].contiguous().view(-1)
                    .view(torch.uint8).numpy().tobytes()
                    for p in pages for k, v in zip(k_bufs, v_bufs) for buf in (k, v))


def pool_donor_main() -> None:
    import torch

    from sglang_swift.control.ledger import DonorLedger
    from sglang_swift.dataplane import KVGeometry

    g = KVGeometry.from_dict(POOL_DONOR)
    arena, layout = _pool_region(g, POOL_PAGES)
    k, v = layout.views(arena.memory.view(-1))  # what SGLang's pool would hold
    gen = torch.Generator().manual_seed(77)
    for buf in k + v:  # the donor's own KV in every page
        buf.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, buf.shape,
                                                  dtype=torch.int16, generator=gen))
    own = [buf.clone() for buf in k + v]
    book = DonorLedger()
    book.offer(range(7, POOL_PAGES, 2))
    try:
        pages = sorted(book.grant("borrower", 1, 12, 0).active)
        desc = arena.export()
        _say({"desc": {**desc, "handle": desc["handle"].hex(), "layout": layout.to_dict()},
              "blocks": pages})
        while True:
            msg = _hear()
            if msg["cmd"] == "digest":  # of the stream's first `used` bytes, as the donor sees it
                kept = [p for p in range(POOL_PAGES) if p not in set(pages)]
                intact = all(  # bitwise: random bit patterns include NaNs
                    torch.equal(now[p * g.page_size:(p + 1) * g.page_size].view(torch.int16),
                                was[p * g.page_size:(p + 1) * g.page_size].view(torch.int16))
                    for now, was in zip(k + v, own) for p in kept)
                stream = _pool_stream(k, v, g.page_size, pages)[: msg["used"]]
                _say({"digest": hashlib.sha256(stream).hexdigest(), "own_pages_intact": intact})
            elif msg["cmd"] == "exit":
                break
    finally:
        del k, v
        arena.close()


def pool_borrower_main() -> None:
    import torch

    from sglang_swift.dataplane import (
        CpuLayerCounter,
        KVGeometry,
        LeasePacking,
        PoolTransferEngine,
        map_pool,
    )

    g = KVGeometry.from_dict(POOL_BORROWER)
    msg = _hear()
    desc = {**msg["desc"], "handle": bytes.fromhex(msg["desc"]["handle"])}
    mapped = map_pool(desc)
    packing = LeasePacking(g, mapped.layout, msg["blocks"])
    rows = 128
    gen = torch.Generator().manual_seed(5)

    def pool():
        return [torch.randn(rows, g.num_kv_heads, g.head_dim, generator=gen).to(g.dtype)
                for _ in range(g.num_layers)]

    k, v = pool(), pool()
    P = g.page_size
    slots = torch.randperm(rows, generator=gen)[: packing.num_blocks * P]  # every block, full
    blocks = torch.randperm(packing.num_blocks, generator=gen)
    engine = PoolTransferEngine(packing, mapped.region, k, v, liveness=mapped.alive)
    stored = engine.begin_store(slots, blocks).wait(TIMEOUT_S)
    # what the stream must now hold: block by block, layer by layer, K then V of its tokens
    order = blocks.argsort()
    expected = b"".join(
        buf[layer][slots[q * P:(q + 1) * P]].contiguous().view(-1).view(torch.uint8).numpy()
        .tobytes() for q in order.tolist() for layer in range(g.num_layers) for buf in (k, v))
    n = slots.numel() - 3  # load back a partial last page, into other, scattered slots
    slots, blocks = slots[:n], blocks[: -(-n // P)]
    k2 = [torch.full_like(x, float("nan")) for x in k]
    v2 = [torch.full_like(x, float("nan")) for x in v]
    loader = PoolTransferEngine(packing, mapped.region, k2, v2, liveness=mapped.alive)
    dst = torch.randperm(rows, generator=gen)[:n]
    counter = CpuLayerCounter(g.num_layers, timeout_s=TIMEOUT_S)
    handle = loader.begin_load(dst, blocks, counter)
    counter.set_consumer(handle.producer_id)
    oks = [counter.wait_until(layer) for layer in range(g.num_layers)]
    identical = all(torch.equal(k2[i][dst].view(torch.int16), k[i][slots].view(torch.int16))
                    and torch.equal(v2[i][dst].view(torch.int16), v[i][slots].view(torch.int16))
                    for i in range(g.num_layers))
    _say({"stored": stored.ok, "load_ok": handle.wait(TIMEOUT_S).ok, "oks": oks,
          "identical": identical, "blocks": packing.num_blocks,
          "unused": packing.unused_bytes, "used": len(expected),
          "digest": hashlib.sha256(expected).hexdigest()})
    engine.close()
    loader.close()
    mapped.close()


def borrower_main(mode: str) -> None:
    import torch

    from sglang_swift.dataplane import (
        CpuLayerCounter,
        KVGeometry,
        LeasePacking,
        PoolTransferEngine,
        map_pool,
    )

    g = KVGeometry.from_dict(GEOMETRY)
    msg = _hear()
    desc = {**msg["desc"], "handle": bytes.fromhex(msg["desc"]["handle"])}
    mapped = map_pool(desc)
    packing = LeasePacking(g, mapped.layout, msg["blocks"])  # one donor page per block
    blocks = list(range(packing.num_blocks))
    gen = torch.Generator().manual_seed(1234)
    num_slots = 128
    k = [
        torch.randn(num_slots, g.num_kv_heads, g.head_dim, generator=gen).to(g.dtype)
        for _ in range(g.num_layers)
    ]
    v = [
        torch.randn(num_slots, g.num_kv_heads, g.v_head_dim, generator=gen).to(g.dtype)
        for _ in range(g.num_layers)
    ]
    pages = torch.randperm(num_slots // g.page_size, generator=gen)[: len(blocks)]
    slots = (pages[:, None] * g.page_size + torch.arange(g.page_size)).reshape(-1)[:N_TOKENS]
    engine = PoolTransferEngine(packing, mapped.region, k, v, liveness=mapped.alive)
    stored = engine.begin_store(slots, blocks).wait(TIMEOUT_S)
    dst = torch.randperm(num_slots, generator=gen)[:N_TOKENS]  # load into other, scattered slots
    k2 = [torch.full_like(x, float("nan")) for x in k]
    v2 = [torch.full_like(x, float("nan")) for x in v]
    counter = CpuLayerCounter(g.num_layers, timeout_s=TIMEOUT_S)
    stop_at = g.num_layers // 2

    def before_layer(layer):
        if mode == "abort" and layer == stop_at:
            _say({"at_layer": layer})
            _hear()  # the parent kills the donor, then says go

    loader = PoolTransferEngine(packing, mapped.region, k2, v2, liveness=mapped.alive)
    handle = loader.begin_load(dst, blocks, counter, before_layer=before_layer)
    counter.set_consumer(handle.producer_id)
    t0 = time.monotonic()
    oks, identical = [], []
    for layer in range(g.num_layers):  # what attention does: wait for layer l, then read it
        oks.append(counter.wait_until(layer))
        identical.append(
            bool(
                torch.equal(k2[layer][dst], k[layer][slots])
                and torch.equal(v2[layer][dst], v[layer][slots])
            )
        )
    elapsed = time.monotonic() - t0
    result = handle.wait(TIMEOUT_S)
    _say(
        {
            "stored": stored.ok,
            "oks": oks,
            "identical": identical,
            "elapsed": elapsed,
            "failed": list(counter.failed_layers()),
            "reason": counter.failure_reason(),
            "load_ok": result.ok,
            "digest": _digest(mapped.arena.memory.view(-1)),
        }
    )
    engine.close()
    loader.close()
    mapped.close()


# ---- the tests -----------------------------------------------------------------------------
class Child:
    def __init__(self, role: str, log_path):
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        root = str(Path(__file__).resolve().parents[2])  # importable without an install
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env={**os.environ, "PYTHONPATH": path},
        )
        self.role, self.log_path, self._buf = role, log_path, b""

    def send(self, obj) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            chunk = os.read(self.proc.stdout.fileno(), 65536) if ready else b""
            if not chunk:
                raise AssertionError(
                    f"{self.role}: no reply (exit code {self.proc.poll()}); "
                    f"stderr: {self.log_path.read_text()[-2000:]}"
                )
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


def _start_pair(tmp_path, mode):
    donor = Child("donor", tmp_path / "donor.log")
    borrower = Child(f"borrower-{mode}", tmp_path / "borrower.log")
    offer = donor.recv()
    borrower.send(offer)
    return donor, borrower, offer


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_two_processes_store_and_load_back_bit_identical(tmp_path):
    from sglang_swift.dataplane import unlink_descriptor

    donor = borrower = offer = None
    try:
        donor, borrower, offer = _start_pair(tmp_path, "roundtrip")
        out = borrower.recv()
        assert out["stored"] and out["load_ok"] and all(out["oks"]), out
        assert all(out["identical"]), out
        donor.send({"cmd": "digest"})
        assert donor.recv()["digest"] == out["digest"]  # the donor's memory holds the stored KV
        donor.send({"cmd": "exit"})
        assert donor.proc.wait(timeout=60) == 0
        assert borrower.proc.wait(timeout=60) == 0
    finally:
        for child in (borrower, donor):
            if child is not None:
                child.stop()
        if offer is not None:
            desc = {**offer["desc"], "handle": bytes.fromhex(offer["desc"]["handle"])}
            unlink_descriptor(desc)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_donor_killed_mid_load_ends_the_wait_and_reports_failed_layers(tmp_path):
    from sglang_swift.dataplane import unlink_descriptor

    donor = borrower = offer = None
    try:
        donor, borrower, offer = _start_pair(tmp_path, "abort")
        stop_at = borrower.recv()["at_layer"]
        donor.proc.kill()
        donor.proc.wait(timeout=30)
        borrower.send({"go": True})
        out = borrower.recv()
        n = GEOMETRY["num_layers"]
        assert out["oks"] == [True] * stop_at + [False] * (n - stop_at), out
        assert out["identical"][:stop_at] == [True] * stop_at
        assert out["failed"] == list(range(stop_at, n)) and out["reason"] == "donor lost"
        assert not out["load_ok"] and out["elapsed"] < TIMEOUT_S
        assert borrower.proc.wait(timeout=60) == 0
    finally:
        for child in (borrower, donor):
            if child is not None:
                child.stop()
        if offer is not None:
            desc = {**offer["desc"], "handle": bytes.fromhex(offer["desc"]["handle"])}
            unlink_descriptor(desc)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_pool_lease_across_two_processes_and_two_shapes(tmp_path):
    """Invariant: a borrower of another shape stores into pages of a donor's live pool mapped
    from its descriptor and layout, loads them back bit-identical layer by layer, the donor's
    own buffers hold exactly the lease's byte stream, and pages it did not lend are untouched."""
    from sglang_swift.dataplane import unlink_descriptor

    donor = borrower = offer = None
    try:
        donor = Child("pool-donor", tmp_path / "donor.log")
        borrower = Child("pool-borrower", tmp_path / "borrower.log")
        offer = donor.recv()
        borrower.send(offer)
        out = borrower.recv()
        assert out["stored"] and out["load_ok"] and all(out["oks"]) and out["identical"], out
        assert out["blocks"] > 1 and 0 <= out["unused"]
        assert out["used"] == out["blocks"] * 5 * 2 * 8 * 16 * 2  # B = L x 2 x page x H x D x 2
        donor.send({"cmd": "digest", "used": out["used"]})
        seen = donor.recv()
        assert seen["digest"] == out["digest"] and seen["own_pages_intact"], seen
        donor.send({"cmd": "exit"})
        assert donor.proc.wait(timeout=60) == 0
        assert borrower.proc.wait(timeout=60) == 0
    finally:
        for child in (borrower, donor):
            if child is not None:
                child.stop()
        if offer is not None:
            desc = {**offer["desc"], "handle": bytes.fromhex(offer["desc"]["handle"])}
            unlink_descriptor(desc)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "donor":
        donor_main()
    elif role == "pool-donor":
        pool_donor_main()
    elif role == "pool-borrower":
        pool_borrower_main()
    else:
        borrower_main(role.split("-", 1)[1])
