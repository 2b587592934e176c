"""A shared region of blocks for the control channel's own tests and benchmarks, lent the way a
server lends its KV pool: a `SharedArena` of `num_blocks x block_bytes` bytes and a pool layout
whose pages are those blocks (one layer, one token a page, K and V half a block each), so a
grant names block ids as a server's grant names page ids. The peers address block b at byte
`b * block_bytes` of the region."""

from __future__ import annotations

from sglang_swift.dataplane import KVGeometry, PoolLayout, SharedArena


def lend_blocks(num_blocks: int, block_bytes: int,
                name_prefix: str = "swc") -> tuple[SharedArena, dict]:
    """(the region, its descriptor with the layout) for `num_blocks` blocks of `block_bytes`
    (a multiple of 512)."""
    if num_blocks <= 0 or block_bytes <= 0 or block_bytes % 4:
        raise ValueError(f"need num_blocks > 0 and block_bytes a positive multiple of 4, got "
                         f"{num_blocks} x {block_bytes}")
    half = block_bytes // 4  # float16 elements of a K (or V) row filling half a block
    layout = PoolLayout(KVGeometry(1, 1, half, half, "float16", 1), rows=num_blocks,
                        padded_rows=num_blocks, data_offset=0)
    arena = SharedArena(num_blocks * block_bytes, name_prefix=name_prefix)
    descriptor = arena.export()
    descriptor["layout"] = layout.to_dict()
    return arena, descriptor


def block_size(memory) -> int:
    """The bytes of one block of a region `lend_blocks` made, from its descriptor: the region
    split evenly over the pool's pages."""
    return memory.block_bytes // memory.num_ids
