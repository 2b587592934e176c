"""The CPU data path: the same transfers as kv_reference, as a few wide gathers per layer.

Why it is fast: rows are moved as 16-byte elements (a complex128 view of the bytes), so torch's
index_select / index_copy_ run as row memcpy; when the local slots of a page are one aligned run
(SGLang's paged allocator gives that) a whole page is one row; and where the destination blocks
are consecutive (a lease's blocks usually are) each run of blocks is a strided view, so a page
moves in one pass with no temporary. Measured on the 2-core CI machine (one thread): a dtype-level
index_put reaches ~0.25x of a contiguous copy, a gather into a temporary then a scatter ~0.5x,
the one-pass runs ~0.8-1.0x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_layout import LayerShape

_WIDE = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16),
         (1, torch.uint8))
CHUNK_PAGES = 256  # bounds the gather temporary (256 pages x 16 tokens x 2 KiB = 8 MiB)


@dataclass(frozen=True)
class RowPlan:
    """Index tensors for one transfer, computed once and reused by every layer."""

    n: int
    page_size: int
    page_aligned: bool
    local_pages: torch.Tensor | None  # full pages: local page id (slot // page_size)
    full_blocks: torch.Tensor | None  # full pages: arena block id
    tail_slots: torch.Tensor | None   # last partial page's slots
    tail_block: int                   # its block (-1 when there is no partial page)
    tok_blocks: torch.Tensor | None   # not page-aligned: per-token block and row
    tok_rows: torch.Tensor | None
    slots: torch.Tensor
    runs: tuple[tuple[int, int, int], ...] = ()  # (first page, pages, first block) when used


def plan_rows(slots: torch.Tensor, blocks: torch.Tensor, page_size: int) -> RowPlan:
    slots = slots.long()
    blocks = blocks.long()
    n = slots.shape[0]
    nfull, rem = divmod(n, page_size)
    full = slots[: nfull * page_size].view(nfull, page_size)
    aligned = bool(
        ((full[:, :1] % page_size) == 0).all()
        and (full == full[:, :1] + torch.arange(page_size)).all()
    ) if nfull else True
    if rem and aligned:
        tail = slots[nfull * page_size:]
        aligned = bool(tail[0] % page_size == 0 and (tail == tail[0] + torch.arange(rem)).all())
    if aligned:
        return RowPlan(n, page_size, True, full[:, 0] // page_size, blocks[:nfull],
                       slots[nfull * page_size:] if rem else None,
                       int(blocks[nfull]) if rem else -1, None, None, slots,
                       _block_runs(blocks[:nfull]))
    tok = torch.arange(n)
    return RowPlan(n, page_size, False, None, None, None, -1, blocks[tok // page_size],
                   tok % page_size, slots)


def _block_runs(blocks: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """Maximal runs of consecutive block ids, or () when they are too short to pay off (one op
    per run; an average run under 4 pages loses to gather-then-scatter)."""
    n = blocks.shape[0]
    if n == 0:
        return ()
    starts = [0] + (torch.nonzero(blocks[1:] != blocks[:-1] + 1).flatten() + 1).tolist()
    if len(starts) * 4 > n:
        return ()
    ends = starts[1:] + [n]
    b = blocks.tolist()
    return tuple((s, e - s, b[s]) for s, e in zip(starts, ends))


def _wide_dtype(*nbytes: int) -> torch.dtype:
    for width, dt in _WIDE:
        if all(x % width == 0 for x in nbytes):
            return dt
    return torch.uint8


def _local_rows(buf: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """[num_slots, H, D] in its dtype -> [num_slots, row_bytes / width] in `wide`."""
    return buf.view(torch.uint8).flatten(1).view(wide)


def _arena_part(arena: torch.Tensor, lo: int, hi: int, wide: torch.dtype) -> torch.Tensor:
    """Bytes [lo, hi) of every block -> [num_blocks, (hi - lo) / width] in `wide`."""
    return arena[:, lo:hi].view(wide)


def _parts(arena, shape: LayerShape, layer, k, v):
    """Yield (local [S, w], arena part [nb, P*w]) for K then V of one layer, in one wide dtype."""
    isz = shape.itemsize
    base = layer * shape.layer_bytes
    kb = shape.page_size * shape.row_k * isz
    spans = ((k, base, base + kb, shape.row_k * isz),
             (v, base + kb, base + shape.layer_bytes, shape.row_v * isz))
    for buf, lo, hi, row_bytes in spans:
        wide = _wide_dtype(row_bytes, lo, arena.shape[1], arena.storage_offset(),
                           buf.stride(0) * isz, buf.storage_offset() * isz)
        yield _local_rows(buf, wide), _arena_part(arena, lo, hi, wide), row_bytes


def _pages_of(local: torch.Tensor, page_size: int) -> torch.Tensor | None:
    """[S, w] -> [S // P, P * w] when rows are back to back, else None."""
    if local.stride(0) != local.shape[1]:
        return None
    usable = local.shape[0] // page_size * page_size
    return local[:usable].reshape(-1, page_size * local.shape[1])


def store_layer_fast(arena, shape: LayerShape, layer, k, v, plan: RowPlan) -> None:
    P = shape.page_size
    for local, part, _ in _parts(arena, shape, layer, k, v):
        part3 = part.view(part.shape[0], P, -1)
        pages = _pages_of(local, P) if plan.page_aligned else None
        if pages is None:
            if plan.page_aligned:  # aligned slots but rows not back to back: go token by token
                blk, row = _coords(plan)
                part3[blk, row] = local.index_select(0, plan.slots)
            else:
                part3[plan.tok_blocks, plan.tok_rows] = local.index_select(0, plan.slots)
            continue
        if plan.runs:  # one pass: gather local pages straight into each run of blocks
            for s, m, b0 in plan.runs:
                torch.index_select(pages, 0, plan.local_pages[s:s + m], out=part[b0:b0 + m])
        else:
            for s in range(0, plan.local_pages.shape[0], CHUNK_PAGES):
                e = s + CHUNK_PAGES
                part.index_copy_(0, plan.full_blocks[s:e],
                                 pages.index_select(0, plan.local_pages[s:e]))
        if plan.tail_slots is not None:
            rem = plan.tail_slots.shape[0]
            part3[plan.tail_block, :rem] = local.index_select(0, plan.tail_slots)


def load_layer_fast(arena, shape: LayerShape, layer, k, v, plan: RowPlan) -> None:
    P = shape.page_size
    for local, part, _ in _parts(arena, shape, layer, k, v):
        part3 = part.view(part.shape[0], P, -1)
        pages = _pages_of(local, P) if plan.page_aligned else None
        if pages is None:
            blk, row = _coords(plan)
            local.index_copy_(0, plan.slots, part3[blk, row])
            continue
        if plan.runs:  # one pass: scatter each run of blocks straight into local pages
            for s, m, b0 in plan.runs:
                # index_put_ measured ~15% faster than index_copy_ for this scatter
                pages.index_put_((plan.local_pages[s:s + m],), part[b0:b0 + m])
        else:
            for s in range(0, plan.local_pages.shape[0], CHUNK_PAGES):
                e = s + CHUNK_PAGES
                pages.index_copy_(0, plan.local_pages[s:e],
                                  part.index_select(0, plan.full_blocks[s:e]))
        if plan.tail_slots is not None:
            rem = plan.tail_slots.shape[0]
            local.index_copy_(0, plan.tail_slots, part3[plan.tail_block, :rem])


def _coords(plan: RowPlan):
    if plan.tok_blocks is not None:
        return plan.tok_blocks, plan.tok_rows
    tok = torch.arange(plan.n)
    blocks = torch.empty(0, dtype=torch.long)
    if plan.full_blocks is not None and plan.full_blocks.numel():
        blocks = plan.full_blocks
    if plan.tail_block >= 0:
        blocks = torch.cat([blocks, torch.tensor([plan.tail_block])])
    return blocks[tok // plan.page_size], tok % plan.page_size
