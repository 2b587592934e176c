"""Where pages sit in a block-major arena, and the checks every transfer runs before touching memory.

The arena is a uint8 tensor [num_blocks, block_bytes]; one block holds one page of one model's KV
laid out as `KVGeometry` says (its `span(layer, kv)`). Local KV (SGLang's MHATokenToKVPool) is one
tensor per layer, [num_slots, H, D], indexed by slot.

A transfer moves `n` tokens: token i lives in local slot `slots[i]` and in row `i % page_size` of
arena block `blocks[i // page_size]`; the last page may be partial. Slots and arena block ids are
two of the three block-number spaces of docs/dataplane.md ("Block numbers").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .geometry import K, V, KVGeometry


def _fail(msg: str) -> None:
    raise ValueError(msg)


def page_address(
    geometry: KVGeometry, blocks: Sequence[int], page: int, layer: int, kv: str, block_bytes: int
) -> tuple[int, int]:
    """(byte offset into the arena's blocks, byte count) of (page `page`, layer, K or V) of a
    transfer whose pages are `blocks` (arena block ids), one page per block: the placement every
    kernel uses. The offset counts from block 0 (the arena memory after its header)."""
    if geometry.page_bytes > block_bytes:
        _fail(f"a page of {geometry} takes {geometry.page_bytes} bytes, more than a block of "
              f"{block_bytes}")
    offset, nbytes = geometry.span(layer, kv)
    return int(blocks[page]) * block_bytes + offset, nbytes


def check_arena(arena: torch.Tensor) -> None:
    if arena.dtype != torch.uint8 or arena.dim() != 2:
        _fail(
            f"arena must be a 2-D uint8 tensor [num_blocks, block_bytes], got {arena.dtype} "
            f"{tuple(arena.shape)}"
        )
    if arena.stride(1) != 1 or arena.stride(0) != arena.shape[1]:
        _fail(f"arena must be contiguous, got strides {arena.stride()}")


def check_fits(arena: torch.Tensor, geometry: KVGeometry) -> None:
    """A page of `geometry` fits one block of `arena`, and blocks start on whole elements."""
    block_bytes = arena.shape[1]
    if block_bytes % geometry.itemsize:
        _fail(f"block_bytes {block_bytes} is not a multiple of the {geometry.dtype} item size")
    if geometry.page_bytes > block_bytes:
        _fail(
            f"a page of {geometry.num_layers} layers ({geometry.page_bytes} bytes) does not fit "
            f"in a block of {block_bytes} bytes; size the arena with choose_block_bytes()"
        )


def check_layer_buffers(
    geometry: KVGeometry, k: torch.Tensor, v: torch.Tensor, name: str = "layer"
) -> None:
    """A local per-layer buffer pair: [num_slots, H, D] each, the (H, D) part contiguous (rows
    any stride), K and V agreeing on slots and device, dtype and (H, D) as `geometry` says."""
    for tag, t in (("K", k), ("V", v)):
        if t.dim() != 3:
            _fail(f"{name} {tag} buffer must be [num_slots, heads, head_dim], got {tuple(t.shape)}")
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            _fail(
                f"{name} {tag} buffer's heads x head_dim must be contiguous, got strides "
                f"{t.stride()}; pass a buffer whose rows are contiguous"
            )
    if k.dtype != v.dtype:
        _fail(f"{name}: K is {k.dtype} but V is {v.dtype}")
    if k.shape[0] != v.shape[0]:
        _fail(f"{name}: K {tuple(k.shape)} and V {tuple(v.shape)} disagree on the slot count")
    if k.device != v.device:
        _fail(f"{name}: K on {k.device} but V on {v.device}")
    g = geometry
    if (k.dtype, k.shape[1], k.shape[2], v.shape[1], v.shape[2]) != (
        g.dtype, g.num_kv_heads, g.head_dim, g.num_kv_heads, g.v_head_dim
    ):
        _fail(f"{name}: buffers {k.dtype} K {tuple(k.shape)} / V {tuple(v.shape)} do not match {g}")


def check_layers(geometry: KVGeometry, k_buffers, v_buffers) -> None:
    """One K and one V buffer per layer of `geometry`, all valid and alike in slots and device."""
    if len(k_buffers) != geometry.num_layers or len(v_buffers) != geometry.num_layers:
        _fail(
            f"geometry has {geometry.num_layers} layers, got {len(k_buffers)} K and "
            f"{len(v_buffers)} V buffers"
        )
    k0 = k_buffers[0]
    for layer, (k, v) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        check_layer_buffers(geometry, k, v, f"layer {layer}")
        if (k.shape[0], k.device) != (k0.shape[0], k0.device):
            _fail(
                f"layer {layer}'s buffers have {k.shape[0]} slots on {k.device}, layer 0's "
                f"{k0.shape[0]} on {k0.device}; every layer must have the same pool"
            )


def check_indices(
    slots: torch.Tensor,
    blocks: torch.Tensor,
    num_slots: int,
    num_blocks: int,
    page_size: int,
    device: torch.device,
    check_ranges: bool = True,
) -> None:
    for tag, t in (("slots", slots), ("blocks", blocks)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            _fail(f"{tag} must be a 1-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
        if t.device != device:
            _fail(f"{tag} is on {t.device} but the buffers are on {device}")
    n = slots.shape[0]
    need = -(-n // page_size)
    if blocks.shape[0] != need:
        _fail(f"{n} tokens in pages of {page_size} need {need} blocks, got {blocks.shape[0]}")
    if check_ranges and n:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= num_slots:
            _fail(f"slot indices span [{lo}, {hi}] but the local buffers have {num_slots} slots")
        lo, hi = int(blocks.min()), int(blocks.max())
        if lo < 0 or hi >= num_blocks:
            _fail(f"block ids span [{lo}, {hi}] but the arena has {num_blocks} blocks")


def check_transfer(arena, geometry: KVGeometry, k_buffers, v_buffers, slots, blocks,
                   check_ranges: bool = True) -> None:
    """Everything a transfer of every layer needs, checked once: raises ValueError naming the
    first problem, before anything is written."""
    check_arena(arena)
    check_layers(geometry, k_buffers, v_buffers)
    k = k_buffers[0]
    if arena.device != k.device and not (arena.is_cuda and k.is_cuda):
        _fail(f"arena on {arena.device} but the local buffers on {k.device}")
    check_fits(arena, geometry)
    check_indices(slots, blocks, k.shape[0], arena.shape[0], geometry.page_size, k.device,
                  check_ranges)


def arena_layer_views(arena: torch.Tensor, geometry: KVGeometry, layer: int):
    """(K, V) views of one layer in every block: [num_blocks, page_size, row] in the KV dtype."""
    typed = arena.view(geometry.dtype)
    views = []
    for kv, row in ((K, geometry.k_row_elems), (V, geometry.v_row_elems)):
        start, count = geometry.elem_span(layer, kv)
        views.append(typed[:, start : start + count].view(-1, geometry.page_size, row))
    return tuple(views)
