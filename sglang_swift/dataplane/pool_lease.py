"""What a pool lease needs of the two pools: the donor's pool mapped from its descriptor, the
page a lending pool offers, and the borrower's own pool's page as a `KVGeometry`, each refused
with the reason when it cannot take part.

Lending is bytes: a donor lends pages of whatever buffers it can give back on demand, described
by their bytes per row per layer (`PoolLayout`): an NHD `MHATokenToKVPool` (K and V rows, any
dtype the copies move: fp8 KV is stored as uint8), or an `MLATokenToKVPool` (one latent buffer
per layer, a latent `KVGeometry`). A hybrid pool's full-attention part is an `MHATokenToKVPool`
and is placed like one; SwiftCache's tree does not serve hybrid models yet, so they are refused
before (integration/backend.py). A borrower's pages are copied as the rows of its own pool, K
and V rows of an `MHATokenToKVPool` or the latent rows of an `MLATokenToKVPool`
(`pool_geometry`, `pool_buffers`).
Refused, with the reason (`why_pool_cannot_lend`, `why_pool_unshareable`): pools keeping scales
beside their rows (FP4, MXFP8 KV: a byte copy of the rows would leave the scales behind), DSA
pools (an indexer buffer beside the latent one), HND / AITER / page-major layouts (a page's rows
elsewhere), and dtypes the copies do not support.
SGLang is never imported here: pools are recognized by their attributes and class names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from swift_kernels import KVGeometry
from swift_kernels.geometry import dtype_name

from .pool_layout import PoolLayout
from .pool_rows import check_buffers
from .sharing import MappedArena, MappingError, map_arena

_SCALES = ("keeps {what} scales in buffers beside its rows (--kv-cache-dtype {dtype}): a byte "
           "copy of the rows would leave them behind")
# SGLang pool classes (0.5.23) whose rows are not all a lease can move, and why (either role).
_REFUSED = {
    "MHATokenToKVPoolFP4": _SCALES.format(what="FP4 block", dtype="fp4_e2m1 / nvfp4"),
    "MLATokenToKVPoolFP4": _SCALES.format(what="FP4 block", dtype="fp4_e2m1 / nvfp4"),
    "MHATokenToKVPoolMXFP8": _SCALES.format(what="MXFP8 block", dtype="mxfp8"),
    "DSATokenToKVPool": "a DSA pool keeps an indexer buffer beside its latent KV",
    "MHATokenToKOnlyPool": "a K-only pool has no V buffers",
    "MiniMaxSparseKVPool": "a sparse pool keeps more than the rows of one KV pool",
    "HybridLinearKVPool": "a hybrid linear-attention pool is not one MHA pool",
}


class UnshareablePool(ValueError):
    """This server's KV pool cannot take part in pool leases; the message says why and what to
    do (run the server without SwiftCache lending or borrowing)."""


def _refused(pool: Any) -> str | None:
    for cls in type(pool).__mro__:
        if cls.__name__ in _REFUSED:
            return f"{type(pool).__name__}: {_REFUSED[cls.__name__]}"
    return None


def why_pool_unshareable(pool: Any) -> str | None:
    """None when `pool` can keep a borrower's rows (an NHD MHA pool, or SGLang's plain MLA pool,
    of a supported dtype); else the reason it cannot."""
    return _refused(pool) or _rows_problem(pool)


def why_pool_cannot_lend(pool: Any) -> str | None:
    """None when a donor can lend pages of `pool`: an NHD MHA pool, or an MLA pool's latent
    buffers, of a dtype the copies move, with nothing kept beside its rows; else the reason.
    The pools a donor lends are the pools a borrower keeps its rows in."""
    return why_pool_unshareable(pool)


def _rows_problem(pool: Any) -> str | None:
    """What keeps a byte copy of `pool`'s rows from being all of its KV (either role)."""
    if is_latent_pool(pool):
        if getattr(pool, "use_dsa", False) or getattr(pool, "kv_scale_buffer", None) is not None:
            return (f"{type(pool).__name__} keeps a DSA indexer or KV scales beside its latent "
                    f"buffers ({_dtype_of(pool)})")
        return _dtype_problem(pool)
    if not isinstance(getattr(pool, "k_buffer", None), list) or not isinstance(
            getattr(pool, "v_buffer", None), list):
        return (f"{type(pool).__name__} has no per-layer k_buffer / v_buffer lists (not an MHA "
                f"pool; a borrower keeps its rows as K and V)")
    if getattr(pool, "k_scale_buffer", None) is not None:
        return (f"{type(pool).__name__} keeps KV scales beside its buffers (quantized KV, "
                f"{_dtype_of(pool)}): a byte copy of the rows would leave them behind")
    return why_layout_unshareable(pool)


def plain_mla_pool(pool: Any) -> bool:
    """SGLang's own MLATokenToKVPool with nothing beside its latent rows (not a subclass, no DSA
    indexer): the MLA pool the shared placement and the host tier serve."""
    return type(pool).__name__ == "MLATokenToKVPool" and not getattr(pool, "use_dsa", False)


def lending_page(pool: Any, page_size: int | None = None) -> KVGeometry:
    """The page a donor lends of `pool` (one TP rank): its KVGeometry (latent for an MLA pool).
    Raises UnshareablePool naming the problem."""
    reason = why_pool_cannot_lend(pool)
    if reason is None:
        return _page_of(pool, page_size)
    raise UnshareablePool(f"this server's KV pool cannot be lent: {reason}; run it without "
                          f"SwiftCache lending")


def _page_of(pool: Any, page_size: int | None) -> KVGeometry:
    page = page_size or pool.page_size
    if is_latent_pool(pool):
        return KVGeometry.latent_page(pool.layer_num, pool.kv_buffer[0].shape[-1],
                                      dtype_name(pool.store_dtype), page)
    return KVGeometry(pool.layer_num, pool.head_num, pool.head_dim,
                      getattr(pool, "v_head_dim", pool.head_dim), dtype_name(pool.store_dtype),
                      page)


def pool_buffers(pool: Any) -> tuple[list, list]:
    """`pool`'s per-layer buffers as (K, V) lists: an MHA pool's K and V buffers, or an MLA
    pool's latent buffers and no V buffers."""
    if is_latent_pool(pool):
        return list(pool.kv_buffer), []
    return list(pool.k_buffer), list(pool.v_buffer)


def pool_device(pool: Any) -> torch.device:
    """The device a pool's buffers are on (K buffers, or an MLA pool's latent ones)."""
    return pool_buffers(pool)[0][0].device


def is_latent_pool(pool: Any) -> bool:
    """One latent buffer per layer and no K / V buffers (an MLA pool)."""
    return isinstance(getattr(pool, "kv_buffer", None), list) and not hasattr(pool, "k_buffer")


def _dtype_of(pool: Any) -> str:
    dtype, store = getattr(pool, "dtype", None), getattr(pool, "store_dtype", None)
    return f"KV dtype {dtype}, stored as {store}" if dtype != store else f"KV dtype {dtype}"


def _dtype_problem(pool: Any) -> str | None:
    try:
        dtype_name(pool.store_dtype)
    except ValueError as exc:
        return f"{_dtype_of(pool)}: the copies do not support it: {exc}"
    return None


def why_layout_unshareable(pool: Any) -> str | None:
    """The checks that need no buffers (the pool's layout, VMM backing, dtype): what the
    lending hook can ask before SGLang allocates them. None when they pass."""
    layout = getattr(pool, "kv_cache_layout", "nhd")
    if layout != "nhd" or getattr(pool, "use_hnd", False):
        return f"KV cache layout {layout!r} (SwiftCache shares only the NHD layout)"
    if getattr(pool, "post_capture_active", False):
        return "post-capture KV backing (CUDA VMM) is on"
    return _dtype_problem(pool)


def pool_geometry(pool: Any, page_size: int | None = None) -> KVGeometry:
    """The page of SGLang pool `pool` (one TP rank) as a KVGeometry, `page_size` tokens per page
    (default: the pool's own): what a borrower keeps in donor pages (latent for an MLA pool).
    Raises UnshareablePool naming the problem, e.g. a pool keeping scales beside its rows."""
    reason = why_pool_unshareable(pool)
    if reason is None:
        geometry = _page_of(pool, page_size)
        reason = _buffer_problem(pool, geometry)
        if reason is None:
            return geometry
    raise UnshareablePool(f"this server's KV pool cannot be shared: {reason}; run it without "
                          f"SwiftCache lending or borrowing")


def _buffer_problem(pool: Any, g: KVGeometry) -> str | None:
    try:
        check_buffers(g, *pool_buffers(pool))
    except ValueError as exc:
        return str(exc)
    return None


@dataclass
class MappedPool:
    """A borrower's mapping of a donor's pool region. `region` is the flat uint8 byte space the
    donor's `layout` addresses (`PoolLayout.chunk_offset`); `arena` the mapping underneath."""

    arena: MappedArena
    layout: PoolLayout
    region: torch.Tensor

    @property
    def descriptor(self) -> dict:
        return self.arena.descriptor

    def alive(self) -> bool:
        """The donor process is there and has not revoked the region."""
        return self.arena.alive()

    def close(self) -> None:
        self.region = None
        self.arena.close()


def map_pool(desc: Any, cuda_index: int | None = None) -> MappedPool:
    """Map a donor's pool from the `MemoryDescriptor` a pool lease's grant carries (a dict or
    the protocol struct, with its `layout`). Raises MappingError (an expected event: run
    without the lease) when the region is gone, too small, or the descriptor has no layout."""
    raw = desc.get("layout") if isinstance(desc, dict) else getattr(desc, "layout", None)
    if raw is None:
        raise MappingError("bad_descriptor", "the descriptor has no pool layout: every lent "
                           "region is a donor's KV pool, described by its layout")
    try:
        layout = PoolLayout.from_dict(raw)
    except ValueError as exc:
        raise MappingError("bad_descriptor", str(exc)) from None
    arena = map_arena(desc, cuda_index)
    region = arena.memory.view(-1)
    need = layout.data_offset + layout.data_bytes
    if region.numel() < need:
        arena.close()
        raise MappingError("size", f"the donor's region holds {region.numel()} bytes, its pool "
                           f"layout needs {need}")
    return MappedPool(arena, layout, region)
