"""Triton kernels for the KV transfers. Imported only by the wrappers, only when Triton is used.

A program copies TOKENS consecutive tokens of one layer; for each token, a BLOCK-wide chunk of
its K row and of its V row (grid axis 1 covers rows wider than BLOCK). Offsets into the arena
and the local pool are int64: an arena of tens of GB has more elements than int32 holds.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .geometry import K


@triton.jit
def _token_coords(slots_ptr, blocks_ptr, t, PAGE: tl.constexpr):
    slot = tl.load(slots_ptr + t).to(tl.int64)
    blk = tl.load(blocks_ptr + t // PAGE).to(tl.int64)
    return slot, blk, t % PAGE


@triton.jit
def store_layer_kernel(
    k_ptr,
    v_ptr,
    k_stride,
    v_stride,
    slots_ptr,
    blocks_ptr,
    arena_ptr,
    block_elems,
    layer_off,
    n_tokens,
    PAGE: tl.constexpr,
    ROW_K: tl.constexpr,
    ROW_V: tl.constexpr,
    BLOCK: tl.constexpr,
    TOKENS: tl.constexpr,
):
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mk = offs < ROW_K
    mv = offs < ROW_V
    for i in tl.static_range(TOKENS):
        t = tl.program_id(0) * TOKENS + i
        if t < n_tokens:
            slot, blk, row = _token_coords(slots_ptr, blocks_ptr, t, PAGE)
            base = blk * block_elems + layer_off
            x = tl.load(k_ptr + slot * k_stride + offs, mask=mk)
            tl.store(arena_ptr + base + row * ROW_K + offs, x, mask=mk)
            y = tl.load(v_ptr + slot * v_stride + offs, mask=mv)
            tl.store(arena_ptr + base + PAGE * ROW_K + row * ROW_V + offs, y, mask=mv)


@triton.jit
def load_layer_kernel(
    k_ptr,
    v_ptr,
    k_stride,
    v_stride,
    slots_ptr,
    blocks_ptr,
    arena_ptr,
    block_elems,
    layer_off,
    n_tokens,
    PAGE: tl.constexpr,
    ROW_K: tl.constexpr,
    ROW_V: tl.constexpr,
    BLOCK: tl.constexpr,
    TOKENS: tl.constexpr,
):
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mk = offs < ROW_K
    mv = offs < ROW_V
    for i in tl.static_range(TOKENS):
        t = tl.program_id(0) * TOKENS + i
        if t < n_tokens:
            slot, blk, row = _token_coords(slots_ptr, blocks_ptr, t, PAGE)
            base = blk * block_elems + layer_off
            x = tl.load(arena_ptr + base + row * ROW_K + offs, mask=mk)
            tl.store(k_ptr + slot * k_stride + offs, x, mask=mk)
            y = tl.load(arena_ptr + base + PAGE * ROW_K + row * ROW_V + offs, mask=mv)
            tl.store(v_ptr + slot * v_stride + offs, y, mask=mv)


# Launch parameters: BLOCK elements per row chunk, TOKENS per program, warps. Defaults chosen for
# rows of 1-2 KiB (8 KV heads x 128); scripts/gpu_check.py sweeps a few and reports the best.
DEFAULT_TUNING = {"block": 1024, "tokens": 4, "num_warps": 4}


def launch(kernel, arena, geometry, layer, k, v, slots, blocks, tuning: dict | None = None) -> None:
    n = slots.shape[0]
    if n == 0:
        return
    tune = {**DEFAULT_TUNING, **(tuning or {})}
    if set(tune) != set(DEFAULT_TUNING) or any(
        not isinstance(x, int) or x <= 0 or x & (x - 1) for x in tune.values()
    ):
        raise ValueError(
            f"tuning must set only {sorted(DEFAULT_TUNING)} to powers of two, got {tuning}"
        )
    row = max(geometry.k_row_elems, geometry.v_row_elems)
    block = min(tune["block"], triton.next_power_of_2(row))
    tokens = tune["tokens"]
    typed = arena.view(geometry.dtype)
    grid = (triton.cdiv(n, tokens), triton.cdiv(row, block))
    kernel[grid](
        k,
        v,
        k.stride(0),
        v.stride(0),
        slots,
        blocks,
        typed,
        typed.stride(0),
        geometry.elem_span(layer, K)[0],  # the kernels find V right after K's page
        n,
        PAGE=geometry.page_size,
        ROW_K=geometry.k_row_elems,
        ROW_V=geometry.v_row_elems,
        BLOCK=block,
        TOKENS=tokens,
        num_warps=tune["num_warps"],
    )
