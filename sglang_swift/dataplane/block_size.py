"""How big an arena block is: one size per arena, enough for one page of every model expected to
borrow from it (`KVGeometry`, swift_kernels/geometry.py, describes the page).

One block size keeps ownership moves O(1): any free block fits any borrower. The price is that a
model whose page is smaller than the largest leaves the difference unused in every block it holds
(`unused_bytes`), which `fit_page_size` wins back with more tokens per block.
"""

from __future__ import annotations

from swift_kernels import KVGeometry

# Every block size is a multiple of this, and so is the arena header (sharing.HEADER_BYTES), so
# every block starts on a 512-byte boundary of a region that is itself at least that aligned
# (POSIX shared memory is page-aligned; PyTorch's CUDA allocator rounds to 512 bytes). Why 512:
# the copies need 16-byte alignment (16-byte vector accesses in the Triton kernels, the CPU path's
# complex128 rows); 128 keeps a block from sharing a GPU cache line (64 a CPU line) with its
# neighbour, which another lease writes; 512 covers both and matches the CUDA allocation
# granularity, so a block copied into a tensor of its own keeps its alignment. The cost is at
# most 511 bytes per block, under 0.03% of a 2 MiB block.
BLOCK_ALIGN_BYTES = 512


def _round_up(x: int, align: int) -> int:
    return (x + align - 1) // align * align


def block_bytes_for(geometry: KVGeometry) -> int:
    """Bytes a block needs to hold one page of `geometry`, rounded up to BLOCK_ALIGN_BYTES."""
    return _round_up(geometry.page_bytes, BLOCK_ALIGN_BYTES)


def choose_block_bytes(geometries: list[KVGeometry]) -> int:
    """Block size of an arena that must serve every geometry in `geometries`: the largest
    `block_bytes_for` among them."""
    if not geometries:
        raise ValueError("choose_block_bytes needs at least one KVGeometry")
    return max(block_bytes_for(g) for g in geometries)


def unused_bytes(geometry: KVGeometry, block_bytes: int) -> int:
    """Bytes of each block that `geometry` leaves unused; raises if its page does not fit."""
    if geometry.page_bytes > block_bytes:
        raise ValueError(
            f"a page of {geometry} takes {geometry.page_bytes} bytes, more than the arena's "
            f"block of {block_bytes}; lower page_size for this model or build the arena with "
            f"choose_block_bytes() over every model that will borrow from it"
        )
    return block_bytes - geometry.page_bytes


def fit_page_size(geometry: KVGeometry, block_bytes: int, multiple_of: int = 1) -> KVGeometry:
    """The same model with the largest page (tokens per block) that fits `block_bytes`, a
    multiple of `multiple_of` (the server's own page size). A model smaller than the one the
    arena was sized for fills its blocks with more tokens instead of leaving bytes unused."""
    page = block_bytes // geometry.bytes_per_token // multiple_of * multiple_of
    if page <= 0:
        raise ValueError(
            f"one token of {geometry} for all layers takes {geometry.bytes_per_token} bytes; a "
            f"block of {block_bytes} cannot hold {multiple_of} of them"
        )
    return geometry.with_page_size(page)
