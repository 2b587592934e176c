"""Block-major arena layout and the checks every transfer wrapper runs before touching memory.

The arena is a uint8 tensor [num_blocks, block_bytes]. One block holds one page of one model's KV,
layer after layer; layer l of a block is K[page_size, H, Dk] followed by V[page_size, H, Dv].
Local KV (SGLang's MHATokenToKVPool) is one tensor per layer, [num_slots, H, D], indexed by slot.

A transfer moves `n` tokens: token i lives in local slot `slots[i]` and in row `i % page_size` of
arena block `blocks[i // page_size]`; the last page may be partial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerShape:
    """What the kernels need to know about one model's rows; derived from the local buffers."""

    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    page_size: int

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def row_k(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def row_v(self) -> int:
        return self.num_kv_heads * self.v_head_dim

    @property
    def layer_elems(self) -> int:
        return self.page_size * (self.row_k + self.row_v)

    @property
    def layer_bytes(self) -> int:
        return self.layer_elems * self.itemsize


def _fail(msg: str) -> None:
    raise ValueError(msg)


def check_arena(arena: torch.Tensor) -> None:
    if arena.dtype != torch.uint8 or arena.dim() != 2:
        _fail(
            f"arena must be a 2-D uint8 tensor [num_blocks, block_bytes], got {arena.dtype} "
            f"{tuple(arena.shape)}"
        )
    if arena.stride(1) != 1 or arena.stride(0) != arena.shape[1]:
        _fail(f"arena must be contiguous, got strides {arena.stride()}")


def check_layer_buffers(k: torch.Tensor, v: torch.Tensor, name: str = "layer") -> None:
    """A local per-layer buffer: [num_slots, H, D], the (H, D) part contiguous, rows any stride."""
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
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        _fail(f"{name}: K {tuple(k.shape)} and V {tuple(v.shape)} disagree on slots or heads")
    if k.device != v.device:
        _fail(f"{name}: K on {k.device} but V on {v.device}")


def shape_of(k: torch.Tensor, v: torch.Tensor, page_size: int) -> LayerShape:
    if not isinstance(page_size, int) or page_size <= 0:
        _fail(f"page_size must be a positive int, got {page_size!r}")
    return LayerShape(k.dtype, k.shape[1], k.shape[2], v.shape[2], page_size)


def check_fits(arena: torch.Tensor, shape: LayerShape, layer: int) -> None:
    block_bytes = arena.shape[1]
    if block_bytes % shape.itemsize:
        _fail(f"block_bytes {block_bytes} is not a multiple of the {shape.dtype} item size")
    if layer < 0 or (layer + 1) * shape.layer_bytes > block_bytes:
        _fail(
            f"layer {layer} does not fit in a block of {block_bytes} bytes "
            f"({shape.layer_bytes} bytes per layer per page)"
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


def arena_layer_views(arena: torch.Tensor, shape: LayerShape, layer: int):
    """(K, V) views of one layer in every block: [num_blocks, page_size, row] in the KV dtype."""
    typed = arena.view(shape.dtype)
    base = layer * shape.layer_elems
    pk = shape.page_size * shape.row_k
    k = typed[:, base : base + pk].view(-1, shape.page_size, shape.row_k)
    v = typed[:, base + pk : base + shape.layer_elems].view(-1, shape.page_size, shape.row_v)
    return k, v
