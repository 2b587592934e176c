"""KV transfer kernels against the plain-torch reference (invariant: every backend writes exactly
the reference's bytes, touches every destination element it owns and nothing else).

Triton runs interpreted on CPU (TRITON_INTERPRET=1, exported by tests/conftest.py for the whole
process); sizes stay small because each interpreted launch costs ~0.1-0.2 s.
"""

from __future__ import annotations

import os

import pytest
import torch

import swift_kernels as sk
from sglang_swift.dataplane import block_bytes_for

os.environ.setdefault("TRITON_INTERPRET", "1")

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
BACKENDS = [
    "vectorized",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not sk.triton_available(),
            reason="triton cannot be imported; the Triton kernels are "
            "tested only where it is installed",
        ),
    ),
]
POISON = 0xA5  # a byte pattern no random KV value is made of


def _local(dtype, num_layers, slots_n, heads, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(slots_n, heads, dk, generator=g).to(dtype) for _ in range(num_layers)]
    v = [torch.randn(slots_n, heads, dv, generator=g).to(dtype) for _ in range(num_layers)]
    return k, v


def _geom(num_layers, page, heads, dk, dv, dtype):
    return sk.KVGeometry(num_layers, heads, dk, dv, dtype, page)


def _arena(num_blocks, num_layers, page, heads, dk, dv, dtype):
    block_bytes = block_bytes_for(_geom(num_layers, page, heads, dk, dv, dtype))
    return torch.full((num_blocks, block_bytes), POISON, dtype=torch.uint8)


def _case(kind, n, page, num_slots, num_blocks, seed):
    """(slots, blocks) for n tokens. `pages`: page-aligned runs of local slots (SGLang's paged
    allocator) into shuffled blocks, `pages-runs`: the same into consecutive blocks,
    `scattered`: arbitrary slots (page_size=1 allocator), passed as a strided view."""
    g = torch.Generator().manual_seed(seed)
    npages = -(-n // page)
    blocks = torch.randperm(num_blocks, generator=g)[:npages]
    if kind == "pages-runs":  # a fresh lease: consecutive block ids (the one-pass CPU path)
        blocks = torch.arange(2, 2 + npages)
    if kind.startswith("pages"):
        local_pages = torch.randperm(num_slots // page, generator=g)[:npages]
        slots = (local_pages[:, None] * page + torch.arange(page)).reshape(-1)[:n]
    else:
        slots = torch.randperm(num_slots, generator=g)[: 2 * n].view(n, 2)[:, 0]  # stride 2
        assert not slots.is_contiguous()
    return slots, blocks


# 3 layers, 5 pages of 4 with the last one partial (n=19): an odd page count and a tail.
L, H, DK, DV, PAGE, N, NSLOTS, NBLOCKS = 3, 2, 8, 4, 4, 19, 64, 9


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["pages", "pages-runs", "scattered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_matches_reference_and_writes_only_its_blocks(dtype, kind, backend):
    """Invariant: a store writes exactly the reference's bytes, every token row it owns, and
    nothing outside its blocks or past the partial page."""
    k, v = _local(dtype, L, NSLOTS, H, DK, DV, seed=1)
    slots, blocks = _case(kind, N, PAGE, NSLOTS, NBLOCKS, seed=2)
    g = _geom(L, PAGE, H, DK, DV, dtype)
    ref = _arena(NBLOCKS, L, PAGE, H, DK, DV, dtype)
    out = ref.clone()
    sk.store_pages(ref, k, v, slots, blocks, g, backend="reference")
    sk.store_pages(out, k, v, slots, blocks, g, backend=backend)
    assert torch.equal(out, ref)
    # Every token row of every layer holds its source row: nothing left poisoned.
    for layer in range(L):
        ak, av = sk.arena_layer_views(out, g, layer)
        for i in range(N):
            b, r = int(blocks[i // PAGE]), i % PAGE
            assert torch.equal(ak[b, r], k[layer][int(slots[i])].reshape(-1))
            assert torch.equal(av[b, r], v[layer][int(slots[i])].reshape(-1))
    # Blocks not in the transfer, and rows past the partial page, stay poisoned.
    untouched = torch.ones(NBLOCKS, dtype=torch.bool)
    untouched[blocks] = False
    assert (out[untouched] == POISON).all()
    tail_block = out[int(blocks[-1])].view(dtype)
    rem = N % PAGE
    tail_rows = tail_block[: g.page_size * g.k_row_elems].view(PAGE, -1)[rem:]
    assert (tail_rows.contiguous().view(torch.uint8) == POISON).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["pages", "pages-runs", "scattered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_load_layer_matches_reference_and_writes_only_its_slots(dtype, kind, backend):
    """Invariant: a layer load writes exactly the reference's bytes into its slots and
    leaves every other slot untouched."""
    k, v = _local(dtype, L, NSLOTS, H, DK, DV, seed=3)
    slots, blocks = _case(kind, N, PAGE, NSLOTS, NBLOCKS, seed=4)
    arena = _arena(NBLOCKS, L, PAGE, H, DK, DV, dtype)
    arena.view(dtype).copy_(torch.randn(arena.view(dtype).shape).to(dtype))  # fresh, never zeros
    layer = 1
    poison = float("nan") if dtype != torch.float16 else -65504.0
    ref_k, ref_v = torch.full_like(k[0], poison), torch.full_like(v[0], poison)
    out_k, out_v = ref_k.clone(), ref_v.clone()
    g = _geom(L, PAGE, H, DK, DV, dtype)
    sk.load_layer(arena, layer, ref_k, ref_v, slots, blocks, g, backend="reference")
    sk.load_layer(arena, layer, out_k, out_v, slots, blocks, g, backend=backend)
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731
    assert same(out_k, ref_k) and same(out_v, ref_v)
    ak, av = sk.arena_layer_views(arena, g, layer)
    for i in range(N):  # every destination row holds its arena row: nothing left poisoned
        b, r, s = int(blocks[i // PAGE]), i % PAGE, int(slots[i])
        assert same(out_k[s].reshape(-1), ak[b, r]) and same(out_v[s].reshape(-1), av[b, r])
    written = torch.zeros(NSLOTS, dtype=torch.bool)
    written[slots] = True
    assert same(out_k[~written], torch.full_like(out_k[~written], poison))
    assert same(out_v[~written], torch.full_like(out_v[~written], poison))


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_is_bit_identical_page_size_one_and_last_partial_page(backend):
    """Invariant: store then load returns the same bits, at page size 1 and with a partial
    last page."""
    dtype = torch.bfloat16
    k, v = _local(dtype, 2, 32, 1, 16, 16, seed=5)
    for page, n in ((1, 7), (8, 13)):
        slots, blocks = _case("scattered", n, page, 32, 16, seed=6 + page)
        arena = _arena(16, 2, page, 1, 16, 16, dtype)
        g = _geom(2, page, 1, 16, 16, dtype)
        sk.store_pages(arena, k, v, slots, blocks, g, backend=backend)
        dst = torch.randperm(32)[:n]
        k2 = [torch.full_like(x, float("nan")) for x in k]
        v2 = [torch.full_like(x, float("nan")) for x in v]
        for layer in range(2):
            sk.load_layer(arena, layer, k2[layer], v2[layer], dst, blocks, g, backend=backend)
            assert torch.equal(k2[layer][dst], k[layer][slots])
            assert torch.equal(v2[layer][dst], v[layer][slots])


def test_fused_kv_buffer_rows_with_a_row_stride_are_handled():
    """SGLang can hold K and V of a layer in one (2, rows, H, D) allocation; a buffer whose rows
    are strided (not back to back) takes the token path and is still exact."""
    dtype = torch.float16
    base = torch.randn(64, 2, 2, 8).to(dtype)  # [slots, k|v, H, D]: K rows have stride 2*H*D
    k, v = [base[:, 0]], [base[:, 1]]
    slots, blocks = _case("pages", 8, 4, 64, 4, seed=9)
    ref, out = _arena(4, 1, 4, 2, 8, 8, dtype), _arena(4, 1, 4, 2, 8, 8, dtype)
    g = _geom(1, 4, 2, 8, 8, dtype)
    sk.store_pages(ref, k, v, slots, blocks, g, backend="reference")
    sk.store_pages(out, k, v, slots, blocks, g, backend="vectorized")
    assert torch.equal(out, ref)


def test_page_address_is_where_the_kernels_put_each_layer_half():
    """Invariant: the geometry's layout is the one the kernels write: at page_address(page,
    layer, K/V) lie exactly that page's token rows of that layer's K or V, the last page
    partial."""
    dtype = torch.bfloat16
    g = _geom(L, PAGE, H, DK, DV, dtype)
    k, v = _local(dtype, L, NSLOTS, H, DK, DV, seed=13)
    slots, blocks = _case("pages", N, PAGE, NSLOTS, NBLOCKS, seed=14)
    arena = _arena(NBLOCKS, L, PAGE, H, DK, DV, dtype)
    sk.store_pages(arena, k, v, slots, blocks, g, backend="vectorized")
    flat = arena.view(-1)
    for page in range(-(-N // PAGE)):
        toks = slots[page * PAGE : (page + 1) * PAGE]
        for layer in range(L):
            for kv, bufs, row in ((sk.K, k, g.k_row_elems), (sk.V, v, g.v_row_elems)):
                off, nbytes = sk.page_address(g, blocks.tolist(), page, layer, kv, arena.shape[1])
                assert nbytes == PAGE * row * g.itemsize
                want = bufs[layer][toks].reshape(-1).view(torch.uint8)
                assert torch.equal(flat[off : off + want.numel()], want)


@pytest.mark.parametrize(
    "problem, message",
    [
        ("slot_range", "slot indices span"),
        ("block_range", "block ids span"),
        ("block_count", "need 2 blocks"),
        ("dtype_mismatch", "K is torch.float16 but V is torch.float32"),
        ("arena_dtype", "2-D uint8"),
        ("layer_outside", "layer 5 is outside this geometry's 1 layers"),
        ("page_too_big", "does not fit in a block"),
        ("geometry_mismatch", "do not match"),
        ("not_a_geometry", "pass the model's KVGeometry"),
        ("inner_stride", "must be contiguous"),
        ("index_dtype", "int32/int64"),
    ],
)
def test_wrappers_reject_bad_inputs_before_writing(problem, message):
    """Invariant: every bad input is refused with a ValueError naming it, before any byte of
    the arena is written."""
    k, v = _local(torch.float16, 1, 16, 2, 8, 8, seed=10)
    k, v = k[0], v[0]
    arena = _arena(4, 1, 4, 2, 8, 8, torch.float16)
    g = _geom(1, 4, 2, 8, 8, torch.float16)
    slots, blocks, layer = torch.arange(8), torch.tensor([0, 1]), 0
    if problem == "slot_range":
        slots = slots + 10
    elif problem == "block_range":
        blocks = torch.tensor([0, 4])
    elif problem == "block_count":
        blocks = torch.tensor([0, 1, 2])
    elif problem == "dtype_mismatch":
        v = v.float()
    elif problem == "arena_dtype":
        arena = arena.view(torch.float16)
    elif problem == "layer_outside":
        layer = 5
    elif problem == "page_too_big":  # 9 layers of this page need more than the block holds
        g = _geom(9, 4, 2, 8, 8, torch.float16)
        layer = 8
    elif problem == "geometry_mismatch":
        g = _geom(1, 4, 2, 8, 4, torch.float16)  # V head dim 4, the buffers have 8
    elif problem == "not_a_geometry":
        g = 4  # a bare page size, as the wrappers once took
    elif problem == "inner_stride":
        k = torch.randn(16, 8, 2).to(torch.float16).transpose(1, 2)
    elif problem == "index_dtype":
        slots = slots.float()
    before = arena.clone()
    with pytest.raises(ValueError, match=message):
        sk.load_layer(arena, layer, k, v, slots, blocks, g, backend="vectorized")
    with pytest.raises(ValueError, match=message):
        sk.store_layer(arena, layer, k, v, slots, blocks, g, backend="vectorized")
    assert torch.equal(arena, before)


def test_backend_choice_is_explained():
    """Invariant: an unknown backend is refused by name; auto picks the vectorized path on
    CPU and Triton on CUDA."""
    with pytest.raises(ValueError, match="unknown backend"):
        sk.resolve_backend("cuda-magic", torch.device("cpu"))
    assert sk.resolve_backend("auto", torch.device("cpu")) == "vectorized"
    assert sk.resolve_backend("auto", torch.device("cuda")) == "triton"


def test_block_runs_are_found_and_short_runs_fall_back():
    """Invariant: consecutive block ids form runs (the one-pass path); fragmented ids fall
    back to gather-then-scatter."""
    from swift_kernels.kv_vectorized import _block_runs

    assert _block_runs(torch.tensor([0, 1, 2, 3, 7, 8, 9, 10])) == ((0, 4, 0), (4, 4, 7))
    assert _block_runs(torch.tensor([5, 1, 9, 3])) == ()  # average run under 4 pages
    plan = sk.plan_rows(torch.arange(16, 32), torch.tensor([4, 5, 6, 7]), 4)
    assert plan.page_aligned and plan.runs == ((0, 4, 4),)


@pytest.mark.skipif(not sk.triton_available(), reason="triton cannot be imported")
@pytest.mark.parametrize("tuning", [{"block": 8, "tokens": 1}, {"block": 16, "tokens": 8}])
def test_triton_launch_shapes_cover_every_row_chunk_and_token(tuning):
    """BLOCK narrower than a row (several chunks per row) and more TOKENS per program than
    tokens left in the last program: still exactly the reference's bytes."""
    dtype = torch.float32
    k, v = _local(dtype, 1, NSLOTS, H, DK, DV, seed=11)  # K rows of 16, V rows of 8 elements
    slots, blocks = _case("scattered", N, PAGE, NSLOTS, NBLOCKS, seed=12)
    g = _geom(1, PAGE, H, DK, DV, dtype)
    ref = _arena(NBLOCKS, 1, PAGE, H, DK, DV, dtype)
    out = ref.clone()
    sk.store_layer(ref, 0, k[0], v[0], slots, blocks, g, backend="reference")
    sk.store_layer(out, 0, k[0], v[0], slots, blocks, g, backend="triton", tuning=tuning)
    assert torch.equal(out, ref)
    k2, v2 = torch.full_like(k[0], float("nan")), torch.full_like(v[0], float("nan"))
    sk.load_layer(out, 0, k2, v2, slots, blocks, g, backend="triton", tuning=tuning)
    assert torch.equal(k2[slots], k[0][slots]) and torch.equal(v2[slots], v[0][slots])
    with pytest.raises(ValueError, match="powers of two"):
        sk.load_layer(out, 0, k2, v2, slots, blocks, g, backend="triton", tuning={"block": 3})
