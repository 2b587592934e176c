"""Triton kernels for the KV transfers. Imported only by the wrappers, only when Triton is used.

One program copies one token's row (or a BLOCK-wide chunk of it) of K and of V for one layer.
Offsets into the arena are int64: an arena of tens of GB has more elements than int32 holds.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_layer_kernel(k_ptr, v_ptr, k_stride, v_stride, slots_ptr, blocks_ptr, arena_ptr,
                       block_elems, layer_off,
                       PAGE: tl.constexpr, ROW_K: tl.constexpr, ROW_V: tl.constexpr,
                       BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    blk = tl.load(blocks_ptr + t // PAGE).to(tl.int64)
    row = t % PAGE
    base = blk * block_elems + layer_off
    mk = offs < ROW_K
    x = tl.load(k_ptr + slot * k_stride + offs, mask=mk)
    tl.store(arena_ptr + base + row * ROW_K + offs, x, mask=mk)
    mv = offs < ROW_V
    y = tl.load(v_ptr + slot * v_stride + offs, mask=mv)
    tl.store(arena_ptr + base + PAGE * ROW_K + row * ROW_V + offs, y, mask=mv)


@triton.jit
def load_layer_kernel(k_ptr, v_ptr, k_stride, v_stride, slots_ptr, blocks_ptr, arena_ptr,
                      block_elems, layer_off,
                      PAGE: tl.constexpr, ROW_K: tl.constexpr, ROW_V: tl.constexpr,
                      BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    blk = tl.load(blocks_ptr + t // PAGE).to(tl.int64)
    row = t % PAGE
    base = blk * block_elems + layer_off
    mk = offs < ROW_K
    x = tl.load(arena_ptr + base + row * ROW_K + offs, mask=mk)
    tl.store(k_ptr + slot * k_stride + offs, x, mask=mk)
    mv = offs < ROW_V
    y = tl.load(arena_ptr + base + PAGE * ROW_K + row * ROW_V + offs, mask=mv)
    tl.store(v_ptr + slot * v_stride + offs, y, mask=mv)


def launch(kernel, arena, shape, layer, k, v, slots, blocks) -> None:
    n = slots.shape[0]
    if n == 0:
        return
    row = max(shape.row_k, shape.row_v)
    block = min(1024, triton.next_power_of_2(row))
    typed = arena.view(shape.dtype)
    grid = (n, triton.cdiv(row, block))
    kernel[grid](k, v, k.stride(0), v.stride(0), slots, blocks, typed,
                 typed.stride(0), layer * shape.layer_elems,
                 PAGE=shape.page_size, ROW_K=shape.row_k, ROW_V=shape.row_v, BLOCK=block)
