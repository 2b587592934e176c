"""A lending server's SGLang KV pool, placed in memory other processes can map.

SGLang sizes its KV pool once at start-up and keeps all of it, so the memory a donor can spare is
the free part of its own pool. For a borrower to copy into that memory, the pool's buffers must be
shareable: POSIX shared memory on CPU, one CUDA allocation (exportable by CUDA IPC) on a GPU.

AROUND hooks on `MHATokenToKVPool._create_buffers_normal` and `MLATokenToKVPool._create_buffers`
(registered by the plugin) do that for a server whose `SwiftConfig` lends: they allocate one
`SharedArena` region and give SGLang per-layer views of it (K and V, or an MLA pool's latent
buffer) with exactly the shapes SGLang would allocate (`PoolLayout`), so every kernel, attention
backend and accounting path sees an ordinary pool. Lending is bytes, so fp8 KV (SGLang stores it
as uint8) is placed like any other dtype. Pools it cannot lay out this way (HND or AITER
layouts, KV with scales, DSA) are built by SGLang as usual, and the server then lends nothing
and says why in its log; so does a pool whose shareable region cannot be
allocated or exported (no shared memory left, a CUDA IPC export refused): the server serves with
SGLang's own buffers. A server that does not lend is never touched.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from ..config import CONFIG_ENV, SwiftConfig
from ..dataplane.pool_layout import KVGeometry, PoolLayout, dtype_name
from ..dataplane.pool_lease import plain_mla_pool, why_layout_unshareable

logger = logging.getLogger(__name__)

REGION_ATTR = "_swiftcache_region"  # the SharedArena holding the pool (kept alive by the pool)
LAYOUT_ATTR = "_swiftcache_layout"  # its PoolLayout


def lending_config() -> SwiftConfig | None:
    """The SwiftConfig of this server process if it lends, else None (read at call time)."""
    text = os.environ.get(CONFIG_ENV)
    if not text:
        return None
    config = SwiftConfig.from_json(text)
    return config if config.enabled and config.lends else None


def layout_of(pool: Any, data_offset: int) -> PoolLayout:
    """The layout of `pool`'s buffers in a shared region: K and V rows, or (an MLA pool, which
    has `kv_cache_dim`) one latent row per token and layer."""
    rows = pool.size + pool.page_size
    padded = -(-rows // pool.page_size) * pool.page_size
    if hasattr(pool, "kv_cache_dim"):
        geometry = KVGeometry.latent_page(pool.layer_num, pool.kv_cache_dim,
                                          dtype_name(pool.store_dtype), pool.page_size)
    else:
        geometry = KVGeometry(pool.layer_num, pool.head_num, pool.head_dim, pool.v_head_dim,
                              dtype_name(pool.store_dtype), pool.page_size)
    return PoolLayout(geometry, rows=rows, padded_rows=padded, data_offset=data_offset)


def create_buffers_in_shared_region(orig: Callable[[Any], None], pool: Any) -> None:
    """AROUND hook body (MHA pools): SGLang's own buffer creation, or the same buffers in a
    shared region."""
    if lending_config() is None:
        return orig(pool)
    reason = why_layout_unshareable(pool)
    if reason is not None:
        logger.warning("SwiftCache: this server's KV pool cannot be shared (%s); it lends nothing",
                       reason)
        return orig(pool)
    _place(orig, pool)
    return None


def create_latent_buffers_in_shared_region(orig: Callable[[Any], None], pool: Any) -> None:
    """AROUND hook body (MLA pools): SGLang's own latent buffers, or the same in a shared
    region. Only SGLang's plain `MLATokenToKVPool` is placed: its subclasses keep more than the
    latent rows (DSA's indexer, FP4 scales) and lend nothing."""
    if lending_config() is None:
        return orig(pool)
    reason = _why_latent_unplaced(pool)
    if reason is not None:
        logger.warning("SwiftCache: this server's MLA KV pool cannot be shared (%s); it lends "
                       "nothing", reason)
        return orig(pool)
    _place(orig, pool)
    return None


def _why_latent_unplaced(pool: Any) -> str | None:
    if not plain_mla_pool(pool):
        return (f"{type(pool).__name__} keeps more than one latent buffer per layer (a DSA "
                f"indexer, or scales)")
    if getattr(pool, "kv_cache_dim", None) != pool.kv_lora_rank + pool.qk_rope_head_dim:
        return f"a packed latent row of {pool.kv_cache_dim} elements"
    return why_layout_unshareable(pool)


def _place(orig: Callable[[Any], None], pool: Any) -> None:
    from ..dataplane import SharedArena
    from ..dataplane.block_size import BLOCK_ALIGN_BYTES

    layout = layout_of(pool, data_offset=0)
    size = -(-layout.data_bytes // BLOCK_ALIGN_BYTES) * BLOCK_ALIGN_BYTES
    try:  # the allocation and its export (shm name, CUDA IPC handle) can fail: serve anyway
        arena = SharedArena(size, device=str(pool.device), name_prefix="swiftpool")
    except Exception as exc:  # noqa: BLE001 - any failure here means "lend nothing"
        logger.warning("SwiftCache: this server's KV pool could not be placed in shareable "
                       "memory (%s: %s); it is built as usual and lends nothing",
                       type(exc).__name__, exc)
        orig(pool)
        return
    region = arena.memory.view(-1)  # after the arena's header; zeroed by shm/torch.empty below
    region.zero_()
    if layout.latent:
        pool.kv_buffer = layout.latent_views(region)
    else:
        pool.k_buffer, pool.v_buffer = layout.views(region)
    setattr(pool, REGION_ATTR, arena)
    setattr(pool, LAYOUT_ATTR, layout)
    logger.info("SwiftCache: KV pool of %d tokens (%d layers, %.1f MiB) placed in shared %s "
                "memory so idle pages can be lent", pool.size, layout.geometry.num_layers,
                layout.data_bytes / 2**20, arena.export()["kind"])


def shared_region_of(pool: Any) -> tuple[Any, PoolLayout] | None:
    """(SharedArena, PoolLayout) of a pool the hook placed, else None."""
    arena = getattr(pool, REGION_ATTR, None)
    return (arena, getattr(pool, LAYOUT_ATTR)) if arena is not None else None
