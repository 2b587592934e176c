"""The packing of borrower pages into a donor's lent pool pages (dataplane/packing.py): its
arithmetic for the paper's pair, and on small pools of every shape pair that each byte of each
borrower block has exactly one home inside the lent pages, where the byte-stream rule says."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_swift.dataplane import KVGeometry
from sglang_swift.dataplane.packing import LeasePacking
from sglang_swift.dataplane.pool_layout import PoolLayout
from swift_kernels import K, V

MiB, KiB = 2**20, 2**10

# (donor page, borrower page): layers, KV heads, head dims, dtypes and page sizes all differ
# somewhere, including a borrower page larger than the donor's and K / V of different widths.
PAIRS = {
    "layers": (KVGeometry(3, 2, 8, 8, "float16", 4), KVGeometry(5, 2, 8, 8, "float16", 4)),
    "heads+dtype": (KVGeometry(4, 2, 16, 16, "bfloat16", 8),
                    KVGeometry(2, 4, 8, 8, "float32", 4)),
    "head_dims+kv_widths": (KVGeometry(2, 1, 24, 8, "float32", 2),
                            KVGeometry(3, 3, 10, 6, "float16", 8)),
    "borrower_page_larger": (KVGeometry(6, 2, 8, 8, "bfloat16", 2),
                             KVGeometry(4, 2, 8, 8, "bfloat16", 16)),
    "qwen3_32b_from_8b_shrunk": (KVGeometry(36, 1, 8, 8, "bfloat16", 4),
                                 KVGeometry(64, 1, 8, 8, "bfloat16", 4)),
}


def pool_of(page: KVGeometry, pages: int, data_offset: int = 0) -> PoolLayout:
    return PoolLayout(page, rows=pages * page.page_size, padded_rows=pages * page.page_size,
                      data_offset=data_offset)


def qwen3(layers: int, page: int) -> KVGeometry:
    return KVGeometry(layers, 8, 128, 128, "bfloat16", page)


def test_qwen3_32b_borrowing_from_qwen3_8b_matches_the_documented_numbers():
    """Invariant: the worked example of docs/dataplane.md: Qwen3-8B's page of 64 is 9 MiB of
    128 KiB chunks, Qwen3-32B's 16 MiB (page 64) or 32 MiB (page 128) of 128 / 256 KiB pieces,
    the unit is 128 KiB, and 100 lent pages hold 56 (28) blocks with 4 MiB unused."""
    donor = pool_of(qwen3(36, 64), 1000)
    lease = LeasePacking(qwen3(64, 64), donor, range(100))
    assert lease.chunk == (128 * KiB, 128 * KiB) and lease.piece == (128 * KiB, 128 * KiB)
    assert lease.donor_page_bytes == 9 * MiB and lease.block_bytes == 16 * MiB
    assert lease.unit == 128 * KiB
    assert (lease.num_blocks, lease.unused_bytes) == (56, 4 * MiB)
    # block 0 is donor page 0 (9 MiB) and the first 7 MiB of page 1: its layer 36 K piece
    # starts at 36 x 256 KiB = 9 MiB, the start of page 1's layer 0 K chunk
    assert lease.pages_of_block(0) == [0, 1]
    assert lease.locate(36 * 256 * KiB) == (1, 0, K, 0)
    assert lease.blocks_touching([1]) == [0, 1]  # page 1 = [9, 18) MiB
    big = LeasePacking(qwen3(64, 128), donor, range(100))
    assert big.piece == (256 * KiB, 256 * KiB) and big.unit == 128 * KiB
    assert (big.num_blocks, big.unused_bytes, big.block_bytes) == (28, 4 * MiB, 32 * MiB)
    # a 256 KiB piece spans two donor chunks: borrower layer 0 K is donor layer 0 K then V,
    # borrower layer 0 V is donor layer 1 K then V
    assert big.locate(0) == (0, 0, K, 0) and big.locate(128 * KiB) == (0, 0, V, 0)
    assert big.locate(256 * KiB) == (0, 1, K, 0) and big.locate(384 * KiB) == (0, 1, V, 0)
    assert LeasePacking.pages_for(qwen3(64, 64), donor, 56) == 100
    assert LeasePacking.pages_for(qwen3(64, 64), donor, 57) == 102  # 57 x 16 / 9 = 101.3


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_block_count_unused_bytes_and_unit_divide_everything(name):
    """Invariant: floor(stream / B) blocks, fewer than B bytes unused, and the unit divides every
    chunk, piece and layer size (so no unit straddles a boundary)."""
    donor_page, borrower = PAIRS[name]
    for n in (1, 3, 7, 10):
        lease = LeasePacking(borrower, pool_of(donor_page, 12), range(n))
        assert lease.stream_bytes == n * donor_page.page_bytes
        assert lease.num_blocks == lease.stream_bytes // borrower.page_bytes
        assert 0 <= lease.unused_bytes < borrower.page_bytes
        for size in (*lease.chunk, *lease.piece, borrower.layer_bytes, lease.donor_page_bytes):
            assert size % lease.unit == 0
        need = LeasePacking.pages_for(borrower, pool_of(donor_page, 12), lease.num_blocks)
        assert need <= n and (need == 0 or LeasePacking(
            borrower, pool_of(donor_page, 12), range(need)).num_blocks == lease.num_blocks)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_every_unit_of_every_block_has_one_home_in_the_lent_pages(name):
    """Invariant: the vectorized unit mapping (plan + donor_units) sends every unit of every
    borrower block to a distinct unit inside a lent page's chunks, at exactly the region offset
    the scalar byte-stream rule (`region_offset`) gives; no unit lands in a page not lent."""
    donor_page, borrower = PAIRS[name]
    donor = pool_of(donor_page, 11, data_offset=4096)
    pages = random.Random(name).sample(range(11), 8)
    lease = LeasePacking(borrower, donor, pages)
    assert lease.num_blocks > 0
    blocks = torch.arange(lease.num_blocks)
    P = borrower.page_size
    slots = torch.arange(lease.num_blocks * P)  # aligned whole pages: the coarse unit
    plan = lease.plan(slots, blocks)
    assert plan.page_aligned and plan.unit == lease.unit
    u = plan.unit
    allowed = set()
    for p in pages:
        for layer in range(donor_page.num_layers):
            for h in (K, V):
                start = donor.chunk_offset(p, layer, h)
                allowed.update(range(start // u, (start + donor.chunk_bytes(h)) // u))
    homes = []
    for layer in range(borrower.num_layers):
        for h in (K, V):
            stream = plan.stream[h] + layer * plan.layer_step
            got = lease.donor_units(stream, u).tolist()
            want = [lease.region_offset(s * u) // u for s in stream.tolist()]
            assert got == want, (layer, h)
            homes += got
    assert len(set(homes)) == len(homes) == lease.num_blocks * borrower.page_bytes // u
    assert set(homes) <= allowed


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_reclaimed_pages_map_to_exactly_the_blocks_that_overlap_them(name):
    """Invariant: blocks_touching(pages) is the set of blocks with a byte in those pages (brute
    force over every block's pages), for single pages and random subsets."""
    donor_page, borrower = PAIRS[name]
    pages = list(range(20, 0, -2))
    lease = LeasePacking(borrower, pool_of(donor_page, 21), pages)
    rng = random.Random(7)
    for chosen in [[p] for p in pages] + [rng.sample(pages, k) for k in (2, 3, 5)]:
        brute = sorted(b for b in range(lease.num_blocks)
                       if set(lease.pages_of_block(b)) & set(chosen))
        assert lease.blocks_touching(chosen) == brute
    assert lease.blocks_touching(pages) == list(range(lease.num_blocks))
    with pytest.raises(ValueError, match="not in this lease"):
        lease.blocks_touching([1])
    assert lease.blocks_touching([1, pages[0]], strict=False) == lease.blocks_touching(pages[:1])


def test_scattered_slots_use_a_unit_that_divides_one_token_row():
    """Invariant: when slots are not whole aligned pages the plan falls back to a unit dividing
    both token rows, and its units still land where the scalar rule says."""
    donor_page, borrower = PAIRS["head_dims+kv_widths"]
    lease = LeasePacking(borrower, pool_of(donor_page, 40), range(0, 40, 3))
    n = lease.num_blocks * borrower.page_size - 5  # a partial last page
    slots = torch.randperm(200, generator=torch.Generator().manual_seed(3))[:n]
    blocks = torch.randperm(lease.num_blocks, generator=torch.Generator().manual_seed(4))
    plan = lease.plan(slots, blocks)
    rows = (borrower.k_row_elems * 2, borrower.v_row_elems * 2)
    assert not plan.page_aligned and rows[K] % plan.unit == 0 and rows[V] % plan.unit == 0
    for h in (K, V):
        stream = plan.stream[h] + 2 * plan.layer_step
        got = lease.donor_units(stream, plan.unit).tolist()
        assert got == [lease.region_offset(s * plan.unit) // plan.unit for s in stream.tolist()]
        per = rows[h] // plan.unit
        assert plan.local[h].tolist() == [s * per + j for s in slots.tolist() for j in range(per)]


def test_bad_leases_are_refused_with_the_reason():
    """Invariant: repeated pages, pages outside the donor pool and non-geometry arguments are
    refused before any arithmetic is used."""
    donor_page, borrower = PAIRS["layers"]
    donor = pool_of(donor_page, 4)
    with pytest.raises(ValueError, match="repeat"):
        LeasePacking(borrower, donor, [1, 2, 1])
    with pytest.raises(ValueError, match="outside the donor pool"):
        LeasePacking(borrower, donor, [0, 4])
    with pytest.raises(ValueError, match="KVGeometry"):
        LeasePacking(donor, donor, [0])
    empty = LeasePacking(borrower, donor, [])
    assert empty.num_blocks == 0 and empty.unused_bytes == 0
    with pytest.raises(IndexError):
        empty.block_span(0)


def _touching_by_loop(lease: LeasePacking, pages) -> list[int]:
    """The reference: each page's byte range [j x D, (j+1) x D) mapped to blocks one by one."""
    out: set[int] = set()
    where = {p: j for j, p in enumerate(lease.donor_pages)}
    for p in pages:
        j = where[int(p)]
        first = j * lease.donor_page_bytes // lease.block_bytes
        last = min(((j + 1) * lease.donor_page_bytes - 1) // lease.block_bytes,
                   lease.num_blocks - 1)
        out.update(range(first, last + 1))
    return sorted(out)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_blocks_touching_matches_the_page_by_page_loop_for_large_unsorted_leases(name):
    """The vectorized lookup equals the per-page arithmetic for leases of scattered pages in
    any order (pages in the unused tail included), lists or tensors, duplicates in the request
    and the whole lease at once; an unknown page is named."""
    donor_page, borrower = PAIRS[name]
    rng = random.Random(11)
    pages = rng.sample(range(600), 257)  # scattered, unsorted; 257 leaves an unused tail
    lease = LeasePacking(borrower, pool_of(donor_page, 600), pages)
    for k in (1, 2, 17, 100, 257):
        chosen = rng.sample(pages, k)
        assert lease.blocks_touching(chosen) == _touching_by_loop(lease, chosen)
        assert lease.blocks_touching(torch.tensor(chosen + chosen[:3])) == \
            _touching_by_loop(lease, chosen)
    tail = [p for j, p in enumerate(pages)
            if j * lease.donor_page_bytes >= lease.num_blocks * lease.block_bytes]
    assert lease.blocks_touching(tail) == []  # bytes only in the unused tail
    assert lease.blocks_touching(pages) == list(range(lease.num_blocks))
    assert lease.blocks_touching([]) == []
    missing = next(p for p in range(600) if p not in set(pages))
    with pytest.raises(ValueError, match=f"donor pages \\[{missing}\\] are not in this lease"):
        lease.blocks_touching([pages[0], missing])
