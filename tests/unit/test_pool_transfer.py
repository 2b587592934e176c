"""Copies between a borrower's pool and a donor's lent pool pages (dataplane/pool_transfer.py).

The donor pool is a real shared region laid out by PoolLayout (as the plugin places a lending
server's pool); the borrower's pool is SGLang-shaped per-layer K / V tensors. Borrower and donor
"devices" are both "cpu" here: the cross-device code path (gather on the source device, copy,
scatter on the destination device) is the same one that runs between two GPUs.
"""

from __future__ import annotations

import math
import os
import threading
import time

import pytest
import torch

import swift_kernels as sk
from sglang_swift.dataplane import CpuLayerCounter, KVGeometry, MappingError, SharedArena
from sglang_swift.dataplane.packing import LeasePacking
from sglang_swift.dataplane.pool_lease import (
    UnshareablePool,
    map_pool,
    pool_geometry,
    why_pool_unshareable,
)
from sglang_swift.dataplane.pool_transfer import PoolTransferEngine
from swift_kernels import K, V
from tests.unit.test_packing import PAIRS, pool_of

POISON = 0xA5


def borrower_pool(g: KVGeometry, rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def one(dim):  # random bit patterns, not values: NaNs and all, compared bitwise
        raw = torch.randint(0, 256, (rows, g.num_kv_heads, dim * g.itemsize), generator=gen,
                            dtype=torch.uint8)
        return raw.view(g.dtype)

    return ([one(g.head_dim) for _ in range(g.num_layers)],
            [one(g.v_head_dim) for _ in range(g.num_layers)])


def poisoned_like(bufs):
    return [torch.full_like(b.view(torch.uint8), POISON).view(b.dtype) for b in bufs]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN patterns included), whatever the two shapes."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def stream_of(region, layout, pages) -> torch.Tensor:
    """The lease's byte stream by the rule's words: each page's chunks, layer by layer, K then
    V (an oracle independent of the unit arithmetic)."""
    parts = []
    for p in pages:
        for layer in range(layout.geometry.num_layers):
            for h in (K, V):
                off = layout.chunk_offset(p, layer, h)
                parts.append(region[off: off + layout.chunk_bytes(h)])
    return torch.cat(parts)


class Lease:
    """A donor pool region (poisoned), a lease of some of its pages, a borrower pool."""

    def __init__(self, name: str, rows=256, seed=0):
        donor_page, self.g = PAIRS[name]
        self.layout = pool_of(donor_page, 24)
        pages_lent = torch.randperm(24, generator=torch.Generator().manual_seed(seed))[:20]
        self.region = torch.full((self.layout.data_bytes,), POISON, dtype=torch.uint8)
        self.pages = pages_lent.tolist()  # 4 pages stay the donor's own
        self.packing = LeasePacking(self.g, self.layout, self.pages)
        self.k, self.v = borrower_pool(self.g, rows, seed)
        self.rows = rows

    def engine(self, k=None, v=None, **kw) -> PoolTransferEngine:
        return PoolTransferEngine(self.packing, self.region, k or self.k, v or self.v, **kw)

    def slots(self, n: int, aligned: bool, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        P = self.g.page_size
        if aligned:
            pages = torch.randperm(self.rows // P, generator=gen)[: -(-n // P)]
            return (pages[:, None] * P + torch.arange(P)).reshape(-1)[:n]
        return torch.randperm(self.rows, generator=gen)[:n]

    def check_stream(self, slots, blocks) -> None:
        """Each stored token's K / V rows sit in the stream where the rule puts them."""
        stream, g = stream_of(self.region, self.layout, self.pages), self.g
        for i, slot in enumerate(slots.tolist()):
            b, r = int(blocks[i // g.page_size]), i % g.page_size
            for layer in range(g.num_layers):
                for h, bufs in ((K, self.k), (V, self.v)):
                    off, count = g.span(layer, h)
                    row = count // g.page_size
                    at = b * g.page_bytes + off + r * row
                    assert same(stream[at: at + row], bufs[layer][slot]), (i, layer, h)


@pytest.mark.parametrize("aligned", [True, False], ids=["pages", "scattered"])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_store_then_layerwise_load_is_bit_identical(name, aligned):
    """Invariant: for every shape pair, a store puts each token's bytes where the byte-stream
    rule says, touches no byte outside the lent pages, and a layer-wise load into poisoned
    slots gives back exactly those bytes while every other slot keeps its poison."""
    lease = Lease(name)
    g, P = lease.g, lease.g.page_size
    n = lease.packing.num_blocks * P - (0 if aligned else P // 2)  # scattered: a partial page
    blocks = torch.randperm(lease.packing.num_blocks, generator=torch.Generator().manual_seed(1))
    blocks = blocks[: -(-n // P)]
    slots = lease.slots(n, aligned, seed=2)
    engine = lease.engine()
    assert engine.begin_store(slots, blocks).wait(30).ok
    lease.check_stream(slots, blocks)
    lent = torch.zeros(lease.region.numel(), dtype=torch.bool)
    for p in lease.pages:
        for layer in range(lease.layout.geometry.num_layers):
            for h in (K, V):
                off = lease.layout.chunk_offset(p, layer, h)
                lent[off: off + lease.layout.chunk_bytes(h)] = True
    assert bool((lease.region[~lent] == POISON).all()), "a store wrote outside the lent pages"
    k2, v2 = poisoned_like(lease.k), poisoned_like(lease.v)
    dst = lease.slots(n, aligned, seed=3)
    loader = lease.engine(k2, v2)
    counter = CpuLayerCounter(g.num_layers, timeout_s=30)
    handle = loader.begin_load(dst, blocks, counter)
    counter.set_consumer(handle.producer_id)
    untouched = torch.ones(lease.rows, dtype=torch.bool)
    untouched[dst] = False
    for layer in range(g.num_layers):
        assert counter.wait_until(layer)
        assert same(k2[layer][dst], lease.k[layer][slots]) and same(v2[layer][dst],
                                                                    lease.v[layer][slots])
        assert bool((k2[layer][untouched].view(torch.uint8) == POISON).all())
    assert handle.wait(30).ok and handle.result().ok
    engine.close()
    loader.close()


def test_a_transfer_maps_its_donor_units_once_for_every_layer(monkeypatch):
    """A store and a load each map their stream units to donor rows in one call per K / V
    half, whatever the layer count (a call per layer and half cost more than a small copy
    moves), and the bytes still land where the stream rule puts them and come back."""
    lease = Lease(sorted(PAIRS)[0])
    g, P = lease.g, lease.g.page_size
    calls = []
    real = lease.packing.donor_units
    monkeypatch.setattr(lease.packing, "donor_units",
                        lambda units, unit: calls.append(unit) or real(units, unit))
    blocks = torch.arange(lease.packing.num_blocks).flip(0)
    n = len(blocks) * P
    slots = lease.slots(n, True, seed=5)
    engine = lease.engine()
    assert engine.store_here(slots, blocks).ok
    assert len(calls) == 2 and g.num_layers > 1
    lease.check_stream(slots, blocks)
    k2, v2 = poisoned_like(lease.k), poisoned_like(lease.v)
    loader = lease.engine(k2, v2)
    dst = lease.slots(n, True, seed=6)
    assert loader.load_here(dst, blocks).ok
    assert len(calls) == 4
    for layer in range(g.num_layers):
        assert same(k2[layer][dst], lease.k[layer][slots])
        assert same(v2[layer][dst], lease.v[layer][slots])
    engine.close()
    loader.close()


@pytest.mark.parametrize("backend", ["reference", "staged", "triton"])
def test_every_row_copy_backend_moves_the_same_bytes(backend):
    """Invariant: the engine's result does not depend on the row-copy backend: the staged CPU
    path, the gather-copy-scatter used between two GPUs ("reference") and the one-pass Triton
    kernel used within one GPU (interpreted here) store and load identical bytes."""
    if backend == "triton" and (not sk.triton_available()
                                or os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("Triton on CPU tensors runs only under TRITON_INTERPRET=1")
    lease = Lease("head_dims+kv_widths")
    P = lease.g.page_size
    blocks = torch.arange(lease.packing.num_blocks).flip(0)
    slots = lease.slots(blocks.numel() * P, True, 4)
    engine = lease.engine(backend=backend)
    assert engine.backend == backend
    assert engine.begin_store(slots, blocks).wait(60).ok
    lease.check_stream(slots, blocks)
    k2, v2 = poisoned_like(lease.k), poisoned_like(lease.v)
    dst = lease.slots(blocks.numel() * P - 3, False, 5)  # scattered, a partial page: fine units
    loader = lease.engine(k2, v2, backend=backend)
    counter = CpuLayerCounter(lease.g.num_layers, timeout_s=60)
    assert loader.begin_load(dst, blocks, counter).wait(60).ok
    for layer in range(lease.g.num_layers):
        assert same(k2[layer][dst], lease.k[layer][slots[:dst.numel()]])
        assert same(v2[layer][dst], lease.v[layer][slots[:dst.numel()]])
    engine.close()
    loader.close()


def _held_load(lease: Lease, stop_at: int, action):
    """Store a prefix, then load it into poisoned slots, running `action(handle)` on the lane
    just before layer `stop_at`. Returns (result, k2, v2, slots, dst, counter)."""
    g, P = lease.g, lease.g.page_size
    nblocks = min(lease.packing.num_blocks, lease.rows // P // 2)
    slots, dst = lease.slots(nblocks * P, True, 5), lease.slots(nblocks * P, True, 6)
    blocks = torch.arange(nblocks)
    assert lease.engine().begin_store(slots, blocks).wait(30).ok
    k2, v2 = poisoned_like(lease.k), poisoned_like(lease.v)
    counter = CpuLayerCounter(g.num_layers, timeout_s=30)
    box, ready = {}, threading.Event()

    def before_layer(layer):
        if layer == stop_at:
            assert ready.wait(10)  # the lane may get here before begin_load returned
            action(box["handle"])

    engine = lease.engine(k2, v2, **getattr(lease, "engine_kw", {}))
    box["handle"] = engine.begin_load(dst, blocks, counter, before_layer=before_layer)
    ready.set()
    result = box["handle"].wait(30)
    engine.close()
    return result, k2, v2, slots, dst, counter


def _layers_split_at(lease, stop_at, k2, v2, slots, dst):
    for layer in range(lease.g.num_layers):
        loaded = same(k2[layer][dst], lease.k[layer][slots]) and same(v2[layer][dst],
                                                                      lease.v[layer][slots])
        poisoned = bool((k2[layer].view(torch.uint8) == POISON).all()
                        and (v2[layer].view(torch.uint8) == POISON).all())
        assert (loaded, poisoned) == ((True, False) if layer < stop_at else (False, True)), layer


def test_abort_mid_load_stops_at_the_next_layer_and_fails_the_rest():
    """Invariant: an aborted load copies no further layer: layers before the abort are exact,
    the rest keep their poison and are reported failed, and waits on them return False."""
    lease = Lease("layers")
    result, k2, v2, slots, dst, counter = _held_load(lease, 2, lambda h: h.abort("test abort"))
    n = lease.g.num_layers
    assert not result.ok and result.failed_layers == tuple(range(2, n))
    counter.set_consumer(0)
    assert counter.wait_until(1) and not counter.wait_until(2)
    _layers_split_at(lease, 2, k2, v2, slots, dst)


@pytest.mark.parametrize("cause", ["deadline", "donor_lost"])
def test_read_deadline_or_lost_donor_mid_load_stops_at_a_layer_boundary(cause):
    """Invariant: once the lease's read deadline passes (or the donor is gone) no further layer
    reads donor memory: the load stops at the next layer boundary with that reason."""
    lease = Lease("heads+dtype")
    now, alive = [0.0], [True]
    lease.engine_kw = dict(clock=lambda: now[0], read_deadline=lambda: 10.0,
                           liveness=lambda: alive[0])

    def expire(_handle):
        if cause == "deadline":
            now[0] = 10.0
        else:
            alive[0] = False

    result, k2, v2, slots, dst, _ = _held_load(lease, 1, expire)
    assert not result.ok and result.failed_layers == tuple(range(1, lease.g.num_layers))
    assert result.reason == ("read deadline passed" if cause == "deadline" else "donor lost")
    _layers_split_at(lease, 1, k2, v2, slots, dst)


def test_store_after_the_read_deadline_writes_nothing():
    """Invariant: a store whose lease deadline has passed never writes the donor's pages."""
    lease = Lease("layers")
    engine = lease.engine(clock=lambda: 5.0, read_deadline=lambda: 5.0)
    P = lease.g.page_size
    result = engine.begin_store(lease.slots(2 * P, True, 1), [0, 1]).wait(30)
    assert not result.ok and result.reason == "read deadline passed"
    assert bool((lease.region == POISON).all())
    engine.close()


def test_abort_returns_only_after_the_layer_in_flight_is_written():
    """Invariant: no thread writes into the borrower's slots after abort() returns: an abort
    that arrives mid-layer waits for that layer, and nothing changes afterwards."""
    lease = Lease("layers")
    P = lease.g.page_size
    nblocks = min(lease.packing.num_blocks, 4)
    slots, dst = lease.slots(nblocks * P, True, 1), lease.slots(nblocks * P, True, 2)
    assert lease.engine().begin_store(slots, torch.arange(nblocks)).wait(30).ok
    k2, v2 = poisoned_like(lease.k), poisoned_like(lease.v)
    engine = lease.engine(k2, v2)
    started, finished = threading.Event(), []
    real_copy = engine._copy_layer

    def slow_copy(plan, layer, store, staging):
        started.set()
        time.sleep(0.3)  # the abort below arrives while this layer is being written
        out = real_copy(plan, layer, store, staging)
        finished.append(time.monotonic())
        return out

    engine._copy_layer = slow_copy
    counter = CpuLayerCounter(lease.g.num_layers, timeout_s=30)
    handle = engine.begin_load(dst, torch.arange(nblocks), counter)
    assert started.wait(10)
    handle.abort("consumer gave up")
    returned = time.monotonic()
    snapshot = [t.clone() for t in k2 + v2]
    assert finished and finished[-1] <= returned
    result = handle.wait(30)
    # the layer copying when the abort came is checked after its copy: failed, not released
    assert not result.ok and len(finished) == 1 and result.failed_layers[0] == 0
    assert counter.failed_layers(handle.producer_id) == tuple(range(lease.g.num_layers))
    assert all(same(a, b) for a, b in zip(snapshot, k2 + v2))
    engine.close()


def test_transfers_are_validated_before_anything_moves():
    """Invariant: a wrong block count, a block outside the lease or repeated, a slot outside the
    pool, a load writing one slot twice, or buffers unlike the geometry raise ValueError naming
    the problem, and nothing is written."""
    lease = Lease("layers")
    P, nb = lease.g.page_size, lease.packing.num_blocks
    engine = lease.engine()
    slots = lease.slots(2 * P, True, 1)
    for s, b, match in ((slots, [0], "need 2 blocks"), (slots, [0, nb], "lease holds"),
                        (slots, [1, 1], "repeats"), (slots + lease.rows, [0, 1], "slots span")):
        with pytest.raises(ValueError, match=match):
            engine.begin_store(s, b)
    counter = CpuLayerCounter(lease.g.num_layers)
    with pytest.raises(ValueError, match="one slot twice"):
        engine.begin_load(torch.zeros(2 * P, dtype=torch.int64), [0, 1], counter)
    with pytest.raises(ValueError, match="does not match"):
        lease.engine([t.float() for t in lease.k], lease.v)
    with pytest.raises(ValueError, match="layers"):
        lease.engine(lease.k[:-1], lease.v[:-1])
    with pytest.raises(ValueError, match="smaller than the donor pool"):
        PoolTransferEngine(lease.packing, lease.region[:100], lease.k, lease.v)
    assert bool((lease.region == POISON).all())
    engine.close()


def test_a_donor_pool_mapped_from_its_descriptor_serves_a_lease():
    """Invariant: map_pool(descriptor with layout) gives the byte space the donor's own SGLang
    views use: what the borrower stores is what the donor's k_buffer / v_buffer hold."""
    donor_page, g = PAIRS["borrower_page_larger"]
    layout = pool_of(donor_page, 24)
    arena = SharedArena(-(-layout.data_bytes // 512) * 512)
    dk, dv = layout.views(arena.memory.view(-1))  # the donor server's own buffers
    mapped = None
    try:
        desc = {**arena.export(), "layout": layout.to_dict()}
        mapped = map_pool(desc)
        assert mapped.layout == layout and mapped.alive()
        pages = [8, 1, 6, 23, 0, 5, 9, 12, 3, 17, 20, 2, 11, 4, 15, 7]
        packing = LeasePacking(g, layout, pages)
        k, v = borrower_pool(g, 64, seed=9)
        engine = PoolTransferEngine(packing, mapped.region, k, v, liveness=mapped.alive)
        slots = torch.arange(packing.num_blocks * g.page_size)
        assert engine.begin_store(slots, torch.arange(packing.num_blocks)).wait(30).ok
        engine.close()
        donor_stream = torch.cat([
            buf[layer][p * donor_page.page_size:(p + 1) * donor_page.page_size]
            .reshape(-1).view(torch.uint8)
            for p in pages for layer in range(donor_page.num_layers) for buf in (dk, dv)])
        P = g.page_size  # slots = arange: block b is the borrower's page b
        mine = torch.cat([buf[layer][b * P:(b + 1) * P].reshape(-1).view(torch.uint8)
                          for b in range(packing.num_blocks) for layer in range(g.num_layers)
                          for buf in (k, v)])
        assert packing.num_blocks == 3
        assert same(donor_stream[: mine.numel()], mine)
        with pytest.raises(MappingError, match="no pool layout"):
            map_pool(arena.export())
    finally:
        if mapped is not None:
            mapped.close()
        del dk, dv
        arena.close()


def test_pools_that_cannot_be_shared_are_refused_with_the_reason():
    """Invariant: non-NHD layouts and unsupported dtypes are refused naming which and why; an
    NHD MHA pool of a supported dtype gives its KVGeometry, an MLA pool its latent one."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    mla = MLATokenToKVPool(size=16, page_size=4, dtype=torch.bfloat16, kv_lora_rank=8,
                           qk_rope_head_dim=4, layer_num=2, device="cpu",
                           enable_memory_saver=False)
    assert why_pool_unshareable(mla) is None
    assert pool_geometry(mla) == KVGeometry(2, 1, 12, 0, "bfloat16", 4)
    mla.store_dtype = torch.float64
    with pytest.raises(UnshareablePool, match="dtype"):
        pool_geometry(mla)
    mha = MHATokenToKVPool(size=16, page_size=4, dtype=torch.float16, head_num=2, head_dim=8,
                           layer_num=3, device="cpu", enable_memory_saver=False)
    assert pool_geometry(mha) == KVGeometry(3, 2, 8, 8, "float16", 4)
    mha.kv_cache_layout = "hnd"
    with pytest.raises(UnshareablePool, match="layout 'hnd'"):
        pool_geometry(mha)
    mha.kv_cache_layout, mha.store_dtype = "nhd", torch.float64
    with pytest.raises(UnshareablePool, match="dtype"):
        pool_geometry(mha)


def test_a_donor_gpu_is_found_by_its_uuid_and_refused_only_when_unreadable(monkeypatch):
    """Invariant: a grant names the donor's GPU by its index there and its UUID; the borrower
    maps it on the GPU with that UUID whatever its own numbering (the index it returns is the
    one the IPC handle is opened on), and refuses, with the reason and the fix, only a GPU it
    does not see or cannot reach (no peer access). CPU memory is always reachable."""
    import types

    from sglang_swift.dataplane.cuda_ipc import check_reachable

    uuids = ["GPU-aaaa", "GPU-bbbb"]
    peer = {"ok": True}
    fake = types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: len(uuids), current_device=lambda: 0,
        get_device_properties=lambda i: types.SimpleNamespace(uuid=uuids[i]),
        can_device_access_peer=lambda a, b: peer["ok"])
    monkeypatch.setattr(torch, "cuda", fake)
    local = torch.device("cuda", 0)
    assert check_reachable("cpu", local) == -1
    assert check_reachable("cuda:1@GPU-bbbb", local) == 1  # the same number here
    assert check_reachable("cuda:0@GPU-bbbb", local) == 1  # numbered differently: by UUID
    assert check_reachable("cuda:7@GPU-aaaa", local) == 0  # the borrower's own GPU
    assert check_reachable("cuda:1", local) == 1  # a label without a UUID: the same numbering
    for label, needle in (("cuda:2@GPU-cccc", "is not one of the 2 GPU(s)"),
                          ("cuda:3", "sees 2 GPU(s)")):
        with pytest.raises(MappingError, match="unreachable") as refused:
            check_reachable(label, local)
        assert needle in str(refused.value) and "CUDA_VISIBLE_DEVICES" in str(refused.value)
    peer["ok"] = False
    with pytest.raises(MappingError, match="no peer access"):
        check_reachable("cuda:0@GPU-bbbb", local)
    assert check_reachable("cuda:0@GPU-aaaa", local) == 0  # the same GPU needs no peer access


def test_an_ipc_handle_opens_on_the_gpu_the_borrower_numbers_it(monkeypatch):
    """Invariant: the CUDA IPC handle's device field is replaced by the borrower's index of the
    donor's GPU before it is opened (the rest of the handle is kept)."""
    from sglang_swift.dataplane import cuda_ipc

    opened = []

    class Storage:
        @staticmethod
        def _new_shared_cuda(*share):
            opened.append(share)
            raise RuntimeError("stop here")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch, "UntypedStorage", Storage)
    handle = cuda_ipc._pack_fields([3, b"h", 64, 0, b"r", 0, b"e", False, 0])
    with pytest.raises(MappingError, match="not_found"):
        cuda_ipc.open_handle(handle, 64, device_index=1)
    assert opened[0][0] == 1 and opened[0][1:] == (b"h", 64, 0, b"r", 0, b"e", False)


def test_a_borrower_that_cannot_read_a_donor_releases_its_grant_and_never_asks_it_again():
    """The pair does not lend (the grant goes back, the donor is avoided from then on) and the
    borrower keeps serving without the lease."""
    import types

    from sglang_swift.dataplane.borrowing import Borrowing

    calls = []
    agent = types.SimpleNamespace(release=lambda key: calls.append(("release", key)),
                                  avoid_donor=lambda d: calls.append(("avoid", d)))
    b = Borrowing.__new__(Borrowing)
    b.agent, b._pending, b._failures, b._retry_at, b.tp = agent, True, 0, 0.0, None
    b._device = torch.device("cpu")  # the borrower's pool is on the CPU
    b.leases = {}
    key = types.SimpleNamespace(donor="big-gpu1", lease_id=3, epoch=1)
    memory = types.SimpleNamespace(kind="cuda_ipc", device="cuda:1@GPU-bbbb")
    b.on_granted(types.SimpleNamespace(key=key, memory=memory, blocks=(0, 1)), tree=None)
    assert calls == [("release", key), ("avoid", "big-gpu1")]
    assert b.leases == {} and not b._pending


def test_a_triton_engine_compiles_its_row_shapes_when_built_and_writes_nothing(monkeypatch):
    """Invariant: an engine on the one-pass Triton copy runs the copy once per row shape its
    transfers will use (the lease's aligned unit and its token-row unit) when it is built (at
    the grant), into scratch rows only: the donor region and the local pool are unchanged, and
    a later transfer of either kind launches no new row shape."""
    from sglang_swift.dataplane import pool_transfer

    seen = []
    real = pool_transfer.sk.copy_rows

    def spy(src, src_rows, dst, dst_rows, **kw):
        seen.append((src.shape[1], src.dtype))
        return real(src, src_rows, dst, dst_rows, **kw)

    monkeypatch.setattr(pool_transfer.sk, "copy_rows", spy)
    lease = Lease("heads+dtype")
    region, k0 = lease.region.clone(), lease.k[0].clone()
    engine = lease.engine(backend="triton")
    try:
        warmed = set(seen)
        assert len(warmed) == 2 or lease.packing.unit == math.gcd(
            lease.packing.unit, lease.g.k_row_elems * lease.g.itemsize,
            lease.g.v_row_elems * lease.g.itemsize)
        assert torch.equal(region, lease.region) and same(k0, lease.k[0])
        n = lease.g.page_size * 3
        for aligned in (True, False):
            slots = lease.slots(n, aligned=aligned, seed=4)
            assert engine.begin_store(slots, [0, 1, 2]).wait(30).ok
        assert set(seen) == warmed
    finally:
        engine.close()
