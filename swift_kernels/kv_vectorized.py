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

from .geometry import K, V, KVGeometry

_WIDE = (
    (16, torch.complex128),
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)
CHUNK_PAGES = 256  # bounds the gather temporary (256 pages x 16 tokens x 2 KiB = 8 MiB)


@dataclass(frozen=True)
class RowPlan:
    """Index tensors for one transfer, computed once and reused by every layer."""

    n: int
    page_size: int
    page_aligned: bool
    local_pages: torch.Tensor | None  # full pages: local page id (slot // page_size)
    full_blocks: torch.Tensor | None  # full pages: arena block id
    tail_slots: torch.Tensor | None  # last partial page's slots
    tail_block: int  # its block (-1 when there is no partial page)
    tok_blocks: torch.Tensor | None  # not page-aligned: per-token block and row
    tok_rows: torch.Tensor | None
    slots: torch.Tensor
    runs: tuple[tuple[int, int, int], ...] = ()  # (first page, pages, first block) when used
    run_pages: tuple[torch.Tensor, ...] = ()  # local_pages of each run, sliced once
    run_pages_np: tuple = ()  # the same as numpy arrays (the load's scatter uses numpy)


def plan_rows(slots: torch.Tensor, blocks: torch.Tensor, page_size: int) -> RowPlan:
    slots = slots.long()
    blocks = blocks.long()
    n = slots.shape[0]
    nfull, rem = divmod(n, page_size)
    full = slots[: nfull * page_size].view(nfull, page_size)
    aligned = (
        bool(
            ((full[:, :1] % page_size) == 0).all()
            and (full == full[:, :1] + torch.arange(page_size)).all()
        )
        if nfull
        else True
    )
    if rem and aligned:
        tail = slots[nfull * page_size :]
        aligned = bool(tail[0] % page_size == 0 and (tail == tail[0] + torch.arange(rem)).all())
    if aligned:
        runs = _block_runs(blocks[:nfull])
        local_pages = full[:, 0] // page_size
        return RowPlan(
            n,
            page_size,
            True,
            local_pages,
            blocks[:nfull],
            slots[nfull * page_size :] if rem else None,
            int(blocks[nfull]) if rem else -1,
            None,
            None,
            slots,
            runs,
            tuple(local_pages[s : s + m] for s, m, _ in runs),
            tuple(local_pages[s : s + m].numpy() for s, m, _ in runs),
        )
    tok = torch.arange(n)
    return RowPlan(
        n, page_size, False, None, None, None, -1, blocks[tok // page_size], tok % page_size, slots
    )


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
    return tuple((s, e - s, b[s]) for s, e in zip(starts, ends, strict=True))


def _wide_dtype(*nbytes: int) -> torch.dtype:
    for width, dt in _WIDE:
        if all(x % width == 0 for x in nbytes):
            return dt
    return torch.uint8


def _parts(arena, geometry: KVGeometry, layer, k, v):
    """Yield (local [S, w], arena part [nb, P*w]) for K then V of one layer, each in the widest
    element that divides every size, offset and stride involved. As few view ops as possible:
    at small transfers their cost (~5 us each) is a visible share of a layer's time."""
    isz = geometry.itemsize
    (k_lo, k_n), (v_lo, v_n) = geometry.span(layer, K), geometry.span(layer, V)
    spans = (
        (k, k_lo, k_lo + k_n, geometry.head_dim * isz),
        (v, v_lo, v_lo + v_n, geometry.v_head_dim * isz),
    )
    for buf, lo, hi, d_bytes in spans:
        wide = _wide_dtype(
            d_bytes,
            lo,
            hi,
            arena.shape[1],
            arena.storage_offset(),
            buf.stride(0) * isz,
            buf.storage_offset() * isz,
        )
        w = wide.itemsize
        lw = buf.view(wide)  # [S, H, D * isz / w]
        local = lw.as_strided((lw.shape[0], lw.shape[1] * lw.shape[2]), (lw.stride(0), 1))
        yield local, arena.view(wide)[:, lo // w : hi // w]


def _pages_of(local: torch.Tensor, page_size: int) -> torch.Tensor | None:
    """[S, w] -> [S // P, P * w] when rows are back to back, else None."""
    if local.stride(0) != local.shape[1]:
        return None
    return local.as_strided(
        (local.shape[0] // page_size, page_size * local.shape[1]), (page_size * local.shape[1], 1)
    )


def store_layer_fast(arena, geometry: KVGeometry, layer, k, v, plan: RowPlan) -> None:
    P = geometry.page_size
    for local, part in _parts(arena, geometry, layer, k, v):
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
            for (_, m, b0), idx in zip(plan.runs, plan.run_pages, strict=True):
                torch.index_select(pages, 0, idx, out=part[b0 : b0 + m])
        else:
            for s in range(0, plan.local_pages.shape[0], CHUNK_PAGES):
                e = s + CHUNK_PAGES
                part.index_copy_(
                    0, plan.full_blocks[s:e], pages.index_select(0, plan.local_pages[s:e])
                )
        if plan.tail_slots is not None:
            rem = plan.tail_slots.shape[0]
            part3[plan.tail_block, :rem] = local.index_select(0, plan.tail_slots)


def load_layer_fast(arena, geometry: KVGeometry, layer, k, v, plan: RowPlan) -> None:
    P = geometry.page_size
    for local, part in _parts(arena, geometry, layer, k, v):
        part3 = part.view(part.shape[0], P, -1)
        pages = _pages_of(local, P) if plan.page_aligned else None
        if pages is None:
            blk, row = _coords(plan)
            local.index_copy_(0, plan.slots, part3[blk, row])
            continue
        if plan.runs:  # one pass: scatter each run of blocks straight into local pages
            # numpy's fancy assignment of whole-page records is a memcpy per page: measured
            # 0.86x of a contiguous copy, against 0.70x for torch's index_put_ / index_copy_
            dst_pages = _records(pages)
            for (_, m, b0), idx in zip(plan.runs, plan.run_pages_np, strict=True):
                dst_pages[idx] = _records(part[b0 : b0 + m])
        else:
            for s in range(0, plan.local_pages.shape[0], CHUNK_PAGES):
                e = s + CHUNK_PAGES
                pages.index_copy_(
                    0, plan.local_pages[s:e], part.index_select(0, plan.full_blocks[s:e])
                )
        if plan.tail_slots is not None:
            rem = plan.tail_slots.shape[0]
            local.index_copy_(0, plan.tail_slots, part3[plan.tail_block, :rem])


def _records(t: torch.Tensor):
    """[rows, w] (CPU, rows of contiguous bytes, any row stride) -> a numpy array of `rows`
    opaque records sharing its memory, so numpy moves each row as one memcpy."""
    import numpy as np

    a = t.view(torch.uint8).numpy()
    return a.view(np.dtype((np.void, a.shape[1])))[:, 0]


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
