"""One donor lease as a `DonorLayerStore` uses it, and the per-layer copies between a lease's
blocks and a pool-shaped buffer (`[rows, heads, dim]` per layer and K/V: a staging buffer or the
host backing).

A lease's donor pages hold `LeasePacking.num_blocks` blocks of this model (docs/dataplane.md,
the pack rule); block b holds one store page, so slot s of that page is row `s % page_size` of
block b. Copies move unit rows (a divisor of the lease's unit and of one token row of K and of V)
straight out of (or into) the mapped donor region: on CPU the staged row copy, on one GPU one
Triton pass; for one run of slots one gather into it (load) or one scatter of it (store);
across GPUs gather, copy, scatter (`swift_kernels.copy_rows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

import swift_kernels as sk
from swift_kernels import K, KVGeometry, V

from ..dataplane.packing import LeasePacking
from ..dataplane.pool_rows import resolve_backend, unit_rows

FREE, GONE = -1, -2  # DonorLease.pages entries that are not a store page


class DonorLease:
    """`pages[b]`: the store page on block b, FREE, or GONE (taken back by the donor; never used
    again). `readable()`: the donor process is there and the lease's read deadline has not
    passed. `where[h][layer, b * page_size + r]`: the region's unit rows (`[n, unit]` view)
    holding row r of block b, layer `layer`, K or V: the packing's arithmetic done once per
    lease, so a copy gathers addresses (8 bytes per unit row per layer: for a 2 KiB K row, 0.4%
    of the KV it addresses)."""

    def __init__(self, number: int, key: Any, geometry: KVGeometry, packing: LeasePacking,
                 region: torch.Tensor, readable: Callable[[], bool]):
        self.number, self.key, self.packing, self.region = number, key, packing, region
        self.readable = readable
        self.mapping: Any = None  # the runtime's name for the donor mapping the region is in
        self.pages = torch.full((packing.num_blocks,), FREE, dtype=torch.int64)
        g, P = geometry, geometry.page_size
        rows = (g.k_row_elems * g.itemsize, g.v_row_elems * g.itemsize)
        self.unit = math.gcd(packing.unit, *rows)
        block_row = torch.arange(packing.num_blocks * P)
        layer_step = torch.arange(g.num_layers)[:, None, None] * (g.layer_bytes // self.unit)
        where = []
        for h in (K, V):
            first = (block_row // P * packing.block_bytes + g.span(0, h)[0]
                     + block_row % P * rows[h]) // self.unit
            stream = (first[:, None] + torch.arange(rows[h] // self.unit))[None] + layer_step
            where.append(packing.donor_units(stream.reshape(-1), self.unit)
                         .view(g.num_layers, -1, rows[h] // self.unit).to(region.device))
        self.where = tuple(where)

    @property
    def held(self) -> int:
        """Blocks of this lease the donor has not taken back."""
        return int((self.pages != GONE).sum())


@dataclass(frozen=True)
class LeaseCopy:
    """Slots `slots[i]` <-> row `slots[i] % page_size` of block `blocks[i]` of `lease`:
    `local[h]` the buffer's unit rows, `block_rows` the rows of `lease.where`, token by token;
    `span[h]` (lo, hi) when `local[h]` is one run lo..hi-1 (sorted contiguous slots)."""

    lease: DonorLease
    local: tuple[torch.Tensor, torch.Tensor]
    span: tuple[tuple[int, int], tuple[int, int]] | None
    block_rows: torch.Tensor
    count: int

    @classmethod
    def of(cls, lease: DonorLease, slots: torch.Tensor, blocks: torch.Tensor, page_size: int,
           device: torch.device) -> "LeaseCopy":
        n = int(slots.numel())
        run = n > 0 and int(slots[-1]) - int(slots[0]) + 1 == n and bool(
            (slots[1:] > slots[:-1]).all())
        local, span = [], []
        for h in (K, V):
            per = lease.where[h].shape[2]
            local.append(((slots * per)[:, None] + torch.arange(per)).reshape(-1).to(device))
            span.append((int(slots[0]) * per, (int(slots[-1]) + 1) * per) if run else None)
        block_rows = (blocks * page_size + slots % page_size).to(lease.region.device)
        return cls(lease, tuple(local), tuple(span) if run else None, block_rows, n)

    def run(self, layer: int, k: torch.Tensor, v: torch.Tensor, to_donor: bool,
            staging: torch.Tensor) -> None:
        """Layer `layer`: `k` / `v` (`[rows, heads, dim]`, contiguous, any device) into the
        lease's blocks (`to_donor`) or out of them."""
        lease = self.lease
        for h, buf in ((K, k), (V, v)):
            local, donor = _unit_rows(buf.reshape(-1).view(torch.uint8), lease.region,
                                      lease.unit)
            where = lease.where[h][layer].index_select(0, self.block_rows).reshape(-1)
            if self.span is not None and local.device == donor.device:
                lo, hi = self.span[h]  # a run of slots: one gather into it, or one scatter of it
                if to_donor:
                    donor.index_copy_(0, where, local[lo:hi])
                else:
                    torch.index_select(donor, 0, where, out=local[lo:hi])
                continue
            rows = self.local[h].to(buf.device)
            src, src_rows, dst, dst_rows = (local, rows, donor, where) if to_donor else \
                (donor, where, local, rows)
            backend = resolve_backend("auto", local.device, donor.device)
            sk.copy_rows(src, src_rows, dst, dst_rows, backend=backend, staging=staging,
                         validate=False)


def _unit_rows(local: torch.Tensor, region: torch.Tensor, unit: int):
    """Both flat uint8 spaces as unit rows as wide as both addresses allow (`unit_rows`; at most
    8 bytes, which every backend here copies)."""
    align = math.gcd(local.data_ptr(), region.data_ptr(), 8)
    return unit_rows(local, unit, align, 8), unit_rows(region, unit, align, 8)
