"""What a borrower needs before it copies into a donor's own pool: the donor's pool mapped from
its descriptor, and its own pool's page as a `KVGeometry`, refused when it cannot be shared.

Both sides of a pool lease are SGLang `MHATokenToKVPool`s: per layer one K and one V tensor
`[rows, heads, dim]`, NHD, rows contiguous. Pools of another kind are refused with the reason
(`why_pool_unshareable`): MLA keeps one latent buffer per layer, not K and V; quantized pools
keep scales beside their buffers that a byte copy would leave behind; HND / AITER / page-major
layouts put a page's rows elsewhere; and the dtype must be one the copies support.
SGLang is never imported here: pools are recognized by their attributes and class names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from swift_kernels import KVGeometry
from swift_kernels.geometry import dtype_name

from .pool_layout import PoolLayout
from .sharing import MappedArena, MappingError, map_arena

# SGLang pool classes (0.5.23) a byte copy of k_buffer / v_buffer cannot serve, and why.
_REFUSED_POOLS = {
    "MLATokenToKVPool": "an MLA pool keeps one latent KV buffer per layer, not K and V",
    "MHATokenToKOnlyPool": "a K-only pool has no V buffers",
    "MHATokenToKVPoolFP4": "an FP4 pool keeps scales beside its buffers",
    "MHATokenToKVPoolMXFP8": "an MXFP8 pool keeps scales beside its buffers",
    "HybridLinearKVPool": "a hybrid linear-attention pool is not one MHA pool",
    "MiniMaxSparseKVPool": "a sparse pool is not one MHA pool",
}


class UnshareablePool(ValueError):
    """This server's KV pool cannot take part in pool leases; the message says why and what to
    do (run the server without SwiftCache lending or borrowing)."""


def why_pool_unshareable(pool: Any) -> str | None:
    """None when `pool` is an NHD MHA pool of a supported dtype; else the reason it is not."""
    for cls in type(pool).__mro__:
        if cls.__name__ in _REFUSED_POOLS:
            return f"{type(pool).__name__}: {_REFUSED_POOLS[cls.__name__]}"
    if not isinstance(getattr(pool, "k_buffer", None), list) or not isinstance(
            getattr(pool, "v_buffer", None), list):
        return (f"{type(pool).__name__} has no per-layer k_buffer / v_buffer lists (not an MHA "
                f"pool; MLA and other pools cannot be shared)")
    if getattr(pool, "k_scale_buffer", None) is not None:
        return f"{type(pool).__name__} keeps KV scales beside its buffers (quantized KV)"
    return why_layout_unshareable(pool)


def why_layout_unshareable(pool: Any) -> str | None:
    """The checks that need no buffers (the pool's layout, VMM backing, dtype): what the
    lending hook can ask before SGLang allocates them. None when they pass."""
    layout = getattr(pool, "kv_cache_layout", "nhd")
    if layout != "nhd" or getattr(pool, "use_hnd", False):
        return f"KV cache layout {layout!r} (SwiftCache shares only the NHD layout)"
    if getattr(pool, "post_capture_active", False):
        return "post-capture KV backing (CUDA VMM) is on"
    try:
        dtype_name(pool.store_dtype)
    except ValueError as exc:
        return f"KV dtype the copies do not support: {exc}"
    return None


def pool_geometry(pool: Any, page_size: int | None = None) -> KVGeometry:
    """The page of SGLang pool `pool` (one TP rank) as a KVGeometry, `page_size` tokens per page
    (default: the pool's own). Raises UnshareablePool naming the problem, e.g. an MLA pool."""
    reason = why_pool_unshareable(pool)
    if reason is None:
        geometry = KVGeometry(pool.layer_num, pool.head_num, pool.head_dim,
                              getattr(pool, "v_head_dim", pool.head_dim),
                              dtype_name(pool.store_dtype), page_size or pool.page_size)
        reason = _buffer_problem(pool, geometry)
        if reason is None:
            return geometry
    raise UnshareablePool(f"this server's KV pool cannot be shared: {reason}; run it without "
                          f"SwiftCache lending or borrowing")


def _buffer_problem(pool: Any, g: KVGeometry) -> str | None:
    if len(pool.k_buffer) != g.num_layers or len(pool.v_buffer) != g.num_layers:
        return f"{len(pool.k_buffer)} K / {len(pool.v_buffer)} V buffers for {g.num_layers} layers"
    for k, v in zip(pool.k_buffer, pool.v_buffer):
        if (k.dim(), k.shape[1:], v.shape[1:]) != (3, (g.num_kv_heads, g.head_dim),
                                                   (g.num_kv_heads, g.v_head_dim)):
            return f"buffers K {tuple(k.shape)} / V {tuple(v.shape)} are not NHD {g}"
        if not (k.is_contiguous() and v.is_contiguous()):
            return "a layer's K or V buffer is not contiguous (rows must be back to back)"
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
