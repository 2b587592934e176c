"""fp8 and other non-scaled KV dtypes on both sides of a pool lease, with SGLang's own pools.

SGLang's `MHATokenToKVPool` keeps fp8 KV (`--kv-cache-dtype fp8_e4m3` / `fp8_e5m2`) in uint8
buffers and views them as the fp8 dtype when attention reads them; lending is bytes, so a donor
of any dtype holds a borrower's rows of any other, and what comes back is byte-identical.
Scaled formats (MXFP8, FP4) keep scales beside their rows, which a byte copy of the rows would
leave behind: they are refused naming the KV dtype and the reason.

`lend_round_trip` is the check both this file and test_models_mla.py run: a donor pool placed in
shared memory by the plugin's hook, mapped by the borrower from its descriptor as the wire
carries it; a store into some of its pages, a load into poisoned slots, a reclaim.
"""

from __future__ import annotations

import pytest
import torch

from sglang_swift.config import CONFIG_ENV, SwiftConfig
from sglang_swift.dataplane import CpuLayerCounter, KVGeometry, UnshareablePool
from sglang_swift.dataplane.packing import LeasePacking
from sglang_swift.dataplane.pool_layout import PoolLayout
from sglang_swift.dataplane.pool_lease import (
    lending_page,
    map_pool,
    pool_buffers,
    pool_geometry,
    why_pool_cannot_lend,
)
from sglang_swift.dataplane.pool_transfer import PoolTransferEngine
from sglang_swift.integration.shared_kv_pool import shared_region_of
from swift_kernels import K, V

POISON = 0xA5
PAGE = 4
LENDING = SwiftConfig(enabled=True, lend_fraction=0.5)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture(scope="module", autouse=True)
def lending_hooks():
    from tests.unit.test_runtime import apply_lending_hooks

    apply_lending_hooks()  # the hooks that put a lending server's pool in shared memory


class Layer:
    """What SGLang's pools read of a RadixAttention layer when they store KV."""

    def __init__(self, layer_id: int):
        self.layer_id, self.k_scale, self.v_scale = layer_id, None, None


def mha_pool(dtype, monkeypatch, lend: bool, size: int = 60, page: int = PAGE, **shape):
    """SGLang's MHATokenToKVPool; `lend`: built as a lending server's scheduler builds it."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if lend:
        monkeypatch.setenv(CONFIG_ENV, LENDING.to_json())
    else:
        monkeypatch.delenv(CONFIG_ENV, raising=False)
    args = {"head_num": 2, "head_dim": 8, "layer_num": 3, **shape}
    pool = MHATokenToKVPool(size=size, page_size=page, dtype=dtype, device="cpu",
                            enable_memory_saver=False, **args)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    return pool


def write_kv(pool, seed: int) -> None:
    """Every slot of every layer through SGLang's own store path (`set_kv_buffer`: values cast
    to the pool's dtype, fp8 viewed as its uint8 storage)."""
    gen = torch.Generator().manual_seed(seed)
    loc = torch.arange(pool.size + pool.page_size)
    for layer in range(pool.layer_num):
        k = torch.randn(loc.numel(), pool.head_num, pool.head_dim, generator=gen) * 4
        v = torch.randn(loc.numel(), pool.head_num, pool.v_head_dim, generator=gen) * 4
        pool.set_kv_buffer(Layer(layer), loc, k.to(pool.dtype), v.to(pool.dtype))


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def lent_mask(layout: PoolLayout, pages) -> torch.Tensor:
    """Bytes of the region that belong to pages `pages` (every layer, K and V chunks)."""
    mask = torch.zeros(layout.data_offset + layout.data_bytes, dtype=torch.bool)
    for p in pages:
        for layer in range(layout.geometry.num_layers):
            for h in (K, V):
                off = layout.chunk_offset(p, layer, h)
                mask[off: off + layout.chunk_bytes(h)] = True
    return mask


def _load(engine, slots, blocks, layers):
    counter = CpuLayerCounter(layers, timeout_s=30)
    handle = engine.begin_load(slots, blocks, counter)
    return handle.wait(30)


def lend_round_trip(donor_pool, borrower_pool, lent_pages, reclaimed_pages, scribble) -> None:
    """A borrower's rows stored into `lent_pages` of the donor's own pool come back
    byte-identical into poisoned slots (SGLang's reads see the same values), no donor byte
    outside the lent pages changes; after `reclaimed_pages` are fenced and the donor writes its
    own KV into them (`scribble(pages)`), the blocks touching them are refused and every other
    block still loads identical."""
    arena, layout = shared_region_of(donor_pool)
    mapped = map_pool({**arena.export(), "layout": layout.to_dict()})  # as a grant carries it
    try:
        assert mapped.layout == layout
        g = pool_geometry(borrower_pool)
        packing = LeasePacking(g, mapped.layout, lent_pages)
        assert packing.num_blocks >= 3, packing
        engine = PoolTransferEngine(packing, mapped.region, *pool_buffers(borrower_pool),
                                    liveness=mapped.alive)
        try:
            _round_trip(engine, packing, mapped, donor_pool, borrower_pool, reclaimed_pages,
                        scribble)
        finally:
            engine.close()
    finally:
        mapped.close()


def _round_trip(engine, packing, mapped, donor_pool, borrower_pool, reclaimed, scribble):
    layers = packing.borrower.num_layers
    nblocks = packing.num_blocks
    blocks = torch.randperm(nblocks, generator=torch.Generator().manual_seed(4))
    pages = torch.randperm(borrower_pool.size // PAGE, generator=torch.Generator().manual_seed(5))
    # whole pages of the borrower's own (page 0 is SGLang's padding page)
    slots = ((pages[:nblocks, None] + 1) * PAGE + torch.arange(PAGE)).reshape(-1)
    region = mapped.region
    before = region.clone()
    mask = lent_mask(packing.donor, packing.donor_pages)
    mask = torch.cat([mask, torch.zeros(region.numel() - mask.numel(), dtype=torch.bool)])
    assert engine.store_here(slots, blocks).ok
    assert torch.equal(region[~mask], before[~mask]), "a store wrote outside the lent pages"
    assert not torch.equal(region[mask], before[mask])
    buffers = [b for half in pool_buffers(borrower_pool) for b in half]  # K, V or latent rows
    want = [raw(b[slots]).clone() for b in buffers]
    want_read = [borrower_pool.get_key_buffer(layer)[slots].clone() for layer in range(layers)]
    for buf in buffers:
        buf.view(torch.uint8)[slots] = POISON
    assert _load(engine, slots, blocks, layers).ok
    for buf, expected in zip(buffers, want, strict=True):
        assert torch.equal(raw(buf[slots]), expected)
    for layer in range(layers):
        read = borrower_pool.get_key_buffer(layer)[slots]  # what attention reads, as its dtype
        assert read.dtype == borrower_pool.dtype and torch.equal(raw(read), raw(want_read[layer]))
    # reclaim: the donor takes pages back; the borrower fences the blocks they touch first
    lost = packing.blocks_touching(reclaimed)
    assert 0 < len(lost) < nblocks
    engine.fence(lost)
    own = region.clone()
    scribble(reclaimed)  # the donor's own KV into its reclaimed pages
    back = lent_mask(packing.donor, reclaimed)
    back = torch.cat([back, torch.zeros(region.numel() - back.numel(), dtype=torch.bool)])
    assert not torch.equal(region[back], own[back]) and torch.equal(region[~back], own[~back])
    at = {int(b): i for i, b in enumerate(blocks)}
    for b in lost:
        i = at[b]
        assert not _load(engine, slots[i * PAGE:(i + 1) * PAGE], blocks[i:i + 1], layers).ok
    kept = [at[b] for b in range(nblocks) if b not in set(lost)]
    sel = torch.cat([slots[i * PAGE:(i + 1) * PAGE] for i in kept])
    for buf in buffers:
        buf.view(torch.uint8)[sel] = POISON
    assert _load(engine, sel, blocks[kept], layers).ok
    rows = torch.cat([torch.arange(i * PAGE, (i + 1) * PAGE) for i in kept])
    for buf, rows_before in zip(buffers, want, strict=True):
        assert torch.equal(raw(buf[sel]), rows_before.view(len(slots), -1)[rows].reshape(-1))


def mha_scribble(pool, seed: int):
    def scribble(pages):
        loc = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])
        gen = torch.Generator().manual_seed(seed)
        for layer in range(pool.layer_num):
            k = torch.randn(loc.numel(), pool.head_num, pool.head_dim, generator=gen) + 9
            pool.set_kv_buffer(Layer(layer), loc, k.to(pool.dtype), k.to(pool.dtype))
    return scribble


PAIRS = {  # borrower dtype, donor dtype
    "e4m3-into-e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn),
    "e5m2-into-bf16": (torch.float8_e5m2, torch.bfloat16),
    "bf16-into-e4m3": (torch.bfloat16, torch.float8_e4m3fn),
    "e4m3-into-e5m2": (torch.float8_e4m3fn, torch.float8_e5m2),
}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_fp8_rows_lent_between_sglang_pools_come_back_byte_identical(name, monkeypatch):
    """Invariant: with SGLang's own pools of fp8 (uint8 storage) and bf16 KV on either side, a
    borrower's rows stored in a donor's lent pages come back byte-identical, SGLang reads the
    same fp8 values, nothing outside the lent pages is written, and after a reclaim only the
    blocks on the reclaimed pages are refused."""
    mine, theirs = PAIRS[name]
    donor = mha_pool(theirs, monkeypatch, lend=True, size=124)
    borrower = mha_pool(mine, monkeypatch, lend=False, size=124, layer_num=5, head_num=1,
                        head_dim=16)
    assert shared_region_of(donor) is not None and shared_region_of(borrower) is None
    write_kv(donor, seed=1)
    write_kv(borrower, seed=2)
    lend_round_trip(donor, borrower, lent_pages=[9, 3, 17, 4, 25, 11, 20, 6, 14, 28],
                    reclaimed_pages=[17, 25], scribble=mha_scribble(donor, seed=3))
    shared_region_of(donor)[0].close()


@pytest.mark.parametrize("dtype", FP8, ids=["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_pool_lends_and_borrows_as_its_uint8_storage(dtype, monkeypatch):
    """Invariant: SGLang stores fp8 KV as uint8, and that storage is the page a donor lends and a
    borrower keeps (one byte per element); its shared region is SGLang's buffers."""
    pool = mha_pool(dtype, monkeypatch, lend=True)
    assert pool.store_dtype == torch.uint8 and why_pool_cannot_lend(pool) is None
    page = KVGeometry(3, 2, 8, 8, "uint8", PAGE)
    assert pool_geometry(pool) == page == lending_page(pool)
    arena, layout = shared_region_of(pool)
    assert layout.geometry == page and layout.chunk_bytes(K) == PAGE * 2 * 8
    write_kv(pool, seed=7)
    region = arena.memory.view(-1)
    off = layout.chunk_offset(5, 2, V)
    assert torch.equal(region[off: off + layout.chunk_bytes(V)],
                       raw(pool.get_value_buffer(2)[5 * PAGE: 6 * PAGE]))
    arena.close()


def test_scaled_kv_formats_are_refused_naming_the_kv_dtype_and_the_reason():
    """Invariant: pools that keep scales beside their rows (MXFP8, FP4) are not lent or
    borrowed; the refusal names the --kv-cache-dtype and why."""
    from sglang.srt.mem_cache import memory_pool as mp

    args = dict(size=16, page_size=PAGE, head_num=2, head_dim=32, layer_num=2, device="cpu",
                enable_memory_saver=False)
    mxfp8 = mp.MHATokenToKVPoolMXFP8(dtype=torch.float8_e4m3fn, **args)
    fp4 = mp.MHATokenToKVPoolFP4(dtype=getattr(torch, "float4_e2m1fn_x2", torch.uint8), **args)
    assert mxfp8.k_scale_buffer is not None and fp4.k_scale_buffer is not None
    for pool, dtype in ((mxfp8, "mxfp8"), (fp4, "fp4")):
        assert dtype in why_pool_cannot_lend(pool) and "scales" in why_pool_cannot_lend(pool)
        with pytest.raises(UnshareablePool, match=f"{dtype}.*scales.*left behind|scales.*{dtype}"):
            lending_page(pool)
        with pytest.raises(UnshareablePool, match="scales"):
            pool_geometry(pool)


@pytest.mark.parametrize("layout, io", [("layer_first", "kernel"), ("page_first", "kernel"),
                                        ("page_first_direct", "direct")])
def test_an_fp8_pools_host_tier_returns_its_rows_byte_identical(layout, io, monkeypatch):
    """Invariant: the host tier (SGLang's host pool over an fp8 device pool) stores and loads
    fp8 KV as its uint8 bytes, unchanged."""
    from sglang_swift.integration.host_tier import HostKV

    pool = mha_pool(torch.float8_e4m3fn, monkeypatch, lend=False, size=64, page=1)
    write_kv(pool, seed=8)
    host = HostKV(pool, ratio=2.0, size_gb=0, layout=layout, io_backend=io, page_size=1)
    src, slots, dst = torch.arange(3, 19), torch.arange(40, 56), torch.arange(20, 36)
    want = [(raw(k[src]).clone(), raw(v[src]).clone())
            for k, v in zip(pool.k_buffer, pool.v_buffer)]
    host.store(src, slots)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.fill_(POISON)
    for layer in range(pool.layer_num):
        host.load_layer(slots, dst, layer)
        assert torch.equal(raw(pool.k_buffer[layer][dst]), want[layer][0])
        assert torch.equal(raw(pool.v_buffer[layer][dst]), want[layer][1])
