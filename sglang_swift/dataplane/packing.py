"""How a borrower's KV pages are packed into the pool pages a donor lent it, for any two shapes.

The rule ("pack"; docs/dataplane.md "Lending the donor's own pool" has a worked example):
- The donor pages granted under one lease, in grant order (`Grant.blocks`), each contribute
  their 2 x L_d chunks (for layer 0..L_d-1: the page's K chunk, then its V chunk) to one ordered
  byte **stream** of n x D bytes, D = L_d x (K chunk + V chunk) bytes.
- Borrower block b (one borrower page: all its layers, K and V, or a latent page's one row per
  layer; B = `geometry.page_bytes` bytes) is stream bytes [b x B, (b+1) x B); inside it
  (layer l, K/V) sits where the borrower's `KVGeometry.span(l, K|V)` says. A piece may
  straddle donor chunks and donor pages.
- The lease holds floor(n x D / B) borrower blocks, numbered 0.. in stream order (these are the
  lease-local block indices the borrower's tree uses); the tail, n x D mod B < B bytes, is unused.
- Copies move **units** of u = gcd(K chunk, V chunk, borrower K piece, borrower V piece, the
  region's data offset) bytes: every chunk and piece boundary is a multiple of u, so a unit never
  straddles anything and one index tensor per (layer, K/V) names every unit of a transfer.

Shards (tensor parallelism): a borrower of `ranks` TP ranks keeps one server page per block, its
ranks' shards side by side: B = ranks x the rank's page bytes, and rank r's shard of block b is
stream bytes [b x B + r x B_r, b x B + (r + 1) x B_r), laid out inside as that rank's
`KVGeometry` says (`shard=(r, ranks)`; B_r = `borrower.page_bytes`). Every rank numbers the
lease's blocks alike, so one tree, replicated on every rank, names one block for all of them.

Reclaim: donor page at grant position j holds stream bytes [j x D, (j+1) x D), so the borrower
blocks it overlaps are a range computed in O(1) (`blocks_touching`, vectorized over the pages).
This module is arithmetic only: it holds no memory and never copies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from swift_kernels import K, KVGeometry, V

from .pool_layout import PoolLayout


@dataclass(frozen=True)
class CopyPlan:
    """Index tensors of one transfer, built once (`LeasePacking.plan`) and used by every layer.

    `local[h]`: unit rows of a borrower layer buffer (K or V viewed as [rows, unit]; a latent
    page has K only, so one entry each) in the order of `stream[h]`: the stream unit rows of
    layer 0's piece; layer l's are `stream[h] + l x layer_step`, which
    `LeasePacking.donor_units` turns into unit rows of the donor's region."""

    unit: int  # bytes per unit row in this transfer
    layer_step: int  # borrower layer bytes / unit
    local: tuple[torch.Tensor, ...]
    stream: tuple[torch.Tensor, ...]
    page_aligned: bool  # whole borrower pages, each one aligned run of slots (coarse units)
    # donor unit rows of every layer, `[layers, units]` per half: filled by the first layer the
    # copy moves (`PoolTransferEngine`, on the copy's own thread and stream), read by the rest
    donor_rows: list = field(default_factory=list, compare=False, repr=False)


class LeasePacking:
    """The packing of `borrower` pages into `donor_pages` (in grant order) of the pool `donor`;
    `shard=(rank, ranks)`: `borrower` is one TP rank's page, and this packing places that rank's
    shard of each block (module docstring)."""

    def __init__(self, borrower: KVGeometry, donor: PoolLayout, donor_pages: Sequence[int],
                 shard: tuple[int, int] = (0, 1)):
        if not isinstance(borrower, KVGeometry) or not isinstance(donor, PoolLayout):
            raise ValueError("LeasePacking takes the borrower's KVGeometry and the donor's "
                             f"PoolLayout, got {type(borrower).__name__} and "
                             f"{type(donor).__name__}")
        rank, ranks = shard
        if not 0 <= rank < ranks:
            raise ValueError(f"shard {shard}: rank must be in 0 .. ranks - 1")
        self.borrower, self.donor = borrower, donor
        self.shard = (int(rank), int(ranks))
        self.donor_pages = tuple(int(p) for p in donor_pages)
        self._position = {p: j for j, p in enumerate(self.donor_pages)}
        if len(self._position) != len(self.donor_pages):
            raise ValueError(f"donor pages repeat in one lease: {list(self.donor_pages)}")
        bad = [p for p in self.donor_pages if not 0 <= p < donor.num_pages]
        if bad:
            raise ValueError(f"donor pages {bad[:8]} are outside the donor pool's "
                             f"{donor.num_pages} pages")
        self.chunk = (donor.chunk_bytes(K), donor.chunk_bytes(V))
        self.piece = (borrower.span(0, K)[1], borrower.span(0, V)[1])
        self.donor_page_bytes = donor.geometry.num_layers * sum(self.chunk)  # D
        self.block_bytes = ranks * borrower.page_bytes  # B: one block holds every rank's shard
        self.shard_offset = rank * borrower.page_bytes  # where this rank's shard starts in it
        self.stream_bytes = len(self.donor_pages) * self.donor_page_bytes
        self.num_blocks = self.stream_bytes // self.block_bytes
        self.unused_bytes = self.stream_bytes - self.num_blocks * self.block_bytes
        self.unit = math.gcd(*self.chunk, *self.piece, donor.data_offset, self.block_bytes,
                             self.shard_offset)
        self._pages_on: dict[torch.device, torch.Tensor] = {}
        # blocks_touching's lookup (the lease's pages sorted, and their grant positions), built
        # here on the grant path, not on the reclaim path
        order = np.argsort(np.asarray(self.donor_pages, dtype=np.int64), kind="stable")
        self._held = np.asarray(self.donor_pages, dtype=np.int64)[order]
        self._position_of = order.astype(np.int64)

    def __repr__(self) -> str:
        shard = "" if self.shard[1] == 1 else f", shard {self.shard[0]} of {self.shard[1]}"
        return (f"LeasePacking({self.num_blocks} blocks of {self.block_bytes} B{shard} in "
                f"{len(self.donor_pages)} donor pages of {self.donor_page_bytes} B, "
                f"{self.unused_bytes} B unused, unit {self.unit} B)")

    @staticmethod
    def pages_for(borrower: KVGeometry, donor: PoolLayout, num_blocks: int,
                  ranks: int = 1) -> int:
        """Donor pages a lease needs to hold `num_blocks` borrower blocks (what to ask for);
        `ranks`: the borrower's TP ranks, `borrower` one rank's page."""
        d = donor.geometry.num_layers * (donor.chunk_bytes(K) + donor.chunk_bytes(V))
        return -(-num_blocks * ranks * borrower.page_bytes // d)

    # ---- scalar addresses (docs, tests, reclaim) ----------------------------------------------
    def block_span(self, block: int) -> tuple[int, int]:
        """Stream bytes [start, end) of borrower block `block`."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} outside this lease's {self.num_blocks} blocks")
        return block * self.block_bytes, (block + 1) * self.block_bytes

    def locate(self, stream_offset: int) -> tuple[int, int, int, int]:
        """(donor page id, layer, K/V, byte within the chunk) holding stream byte
        `stream_offset`."""
        if not 0 <= stream_offset < self.stream_bytes:
            raise IndexError(f"stream byte {stream_offset} outside {self.stream_bytes}")
        j, r = divmod(stream_offset, self.donor_page_bytes)
        layer, q = divmod(r, sum(self.chunk))
        half = K if q < self.chunk[K] else V
        return self.donor_pages[j], layer, half, q - half * self.chunk[K]

    def region_offset(self, stream_offset: int) -> int:
        """Byte offset in the donor's region of stream byte `stream_offset`."""
        page, layer, half, off = self.locate(stream_offset)
        return self.donor.chunk_offset(page, layer, half) + off

    def blocks_touching(self, pages: Iterable[int], strict: bool = True) -> list[int]:
        """Sorted borrower blocks whose bytes lie (partly) in any of `pages` (donor page ids of
        this lease, e.g. a `Reclaim.blocks`): they become unreadable once those pages go back.
        Vectorized, O(len(pages) log(lease pages) + blocks): it runs on the borrower's agent
        thread while a donor waits for a reclaim (a Python loop took 2.2 ms for 2048 pages on
        this CPU, this 0.2-0.4 ms; numpy, not torch, whose first op on a process's new thread
        took 5 ms). A page this lease does not hold raises ValueError, or is skipped with
        `strict=False`."""
        if isinstance(pages, torch.Tensor):
            pages = pages.cpu().numpy()
        want = np.asarray(pages if isinstance(pages, np.ndarray) else list(pages),
                          dtype=np.int64).reshape(-1)
        if want.size == 0:
            return []
        held, position = self._held, self._position_of
        at = np.minimum(np.searchsorted(held, want), held.size - 1)
        known = held[at] == want
        if strict and not known.all():
            raise ValueError(f"donor pages {want[~known][:8].tolist()} are not in this lease "
                             f"({len(self.donor_pages)} pages)")
        j = position[at[known]]
        first = j * self.donor_page_bytes // self.block_bytes
        last = np.minimum(((j + 1) * self.donor_page_bytes - 1) // self.block_bytes,
                          self.num_blocks - 1)
        some = first <= last  # a page wholly in the unused tail touches no block
        edges = np.zeros(self.num_blocks + 1, dtype=np.int64)
        np.add.at(edges, first[some], 1)
        np.add.at(edges, last[some] + 1, -1)
        return np.flatnonzero(np.cumsum(edges[:-1]) > 0).tolist()

    def pages_of_block(self, block: int) -> list[int]:
        """Donor page ids (grant order) holding some byte of borrower block `block`."""
        start, end = self.block_span(block)
        first, last = start // self.donor_page_bytes, (end - 1) // self.donor_page_bytes
        return list(self.donor_pages[first: last + 1])

    # ---- index tensors for copies --------------------------------------------------------------
    def plan(self, slots: torch.Tensor, blocks: torch.Tensor,
             aligned: bool | None = None) -> CopyPlan:
        """The unit rows of a transfer of `len(slots)` tokens: token i is borrower slot
        `slots[i]` and row i % page_size of lease block `blocks[i // page_size]` (int64
        tensors, already validated; `blocks` on the CPU, `slots` on the CPU or the pool's
        device, where its unit rows are computed). Whole pages whose slots are one aligned run
        move in units of `self.unit`; anything else (a partial last page, scattered slots) in
        units that divide one token row, so every layout works and the common one moves the
        fewest, widest rows. `aligned` None: found from the slots' values; else given by the
        caller (SGLang's allocator hands whole aligned pages), and the slots are not read."""
        g, n = self.borrower, slots.shape[0]
        P = g.page_size
        rows = (g.k_row_elems * g.itemsize, g.v_row_elems * g.itemsize)
        first = slots[::P]
        if aligned is None:
            aligned = bool(n % P == 0 and n > 0 and (first % P == 0).all()
                           and (slots.view(-1, P) == first[:, None] + torch.arange(P)).all())
        unit = self.unit if aligned else math.gcd(self.unit, *rows)
        local, stream = [], []
        for h in g.halves:
            piece_start = self.shard_offset + g.span(0, h)[0]
            if aligned:
                per = P * rows[h] // unit  # units per page piece
                lo, base = first // P * per, blocks * self.block_bytes + piece_start
            else:
                per = rows[h] // unit  # units per token row
                tok = torch.arange(n)
                lo = slots * per
                base = blocks[tok // P] * self.block_bytes + piece_start + tok % P * rows[h]
            ar = torch.arange(per)
            local.append((lo[:, None] + torch.arange(per, device=lo.device)).reshape(-1))
            stream.append((base[:, None] // unit + ar).reshape(-1))
        return CopyPlan(unit, g.layer_bytes // unit, tuple(local), tuple(stream), aligned)

    def donor_units(self, stream_units: torch.Tensor, unit: int) -> torch.Tensor:
        """Unit rows of the donor's region (viewed as [bytes / unit, unit]) holding the stream
        unit rows `stream_units` (any device; a few elementwise ops, no host sync)."""
        d = self.donor
        if self.unit % unit or d.data_offset % unit:
            raise ValueError(f"unit {unit} does not divide this lease's unit {self.unit}")
        k_u, v_u = self.chunk[K] // unit, self.chunk[V] // unit
        page_u = self.donor_page_bytes // unit
        j = stream_units.div(page_u, rounding_mode="floor")
        r = stream_units - j * page_u
        layer = r.div(k_u + v_u, rounding_mode="floor")
        q = r - layer * (k_u + v_u)
        is_v = (q >= k_u).long()
        pages = self._pages_tensor(stream_units.device)[j]
        return (d.data_offset // unit + layer * (d.layer_stride // unit)
                + is_v * (d.v_offset // unit + (v_u - k_u) * pages) + pages * k_u
                + q - is_v * k_u)

    def _pages_tensor(self, device: torch.device) -> torch.Tensor:
        t = self._pages_on.get(device)
        if t is None:
            t = torch.tensor(self.donor_pages, dtype=torch.int64).to(device)
            self._pages_on[device] = t
        return t
