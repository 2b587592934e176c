"""Depth 0 of the layer stream cache: a KV pool whose rows past the local ones are read in
place, in donor pool pages under leases or, where no lease holds them, in host memory.

`--swiftcache-layer-stream donor --swiftcache-layer-stream-depth 0` gives SGLang a pool of N
slots with SGLang's logical shape (one `(2, rows, heads, head_dim)` buffer per layer, K then V),
but each layer's buffer is a range of virtual addresses onto which pieces of memory are mapped
(as `layer_views.py` does for resident rows):

- rows `[0, R)`: the layer's own local memory (R = the resident fraction of N);
- rows `[R, rows)`: **pieces** of `piece_bytes` each (a multiple of the mapping granularity and
  of one row), each mapped either from the pool's host backing or, once a lease holds it, from
  a **donor chunk**: `piece_bytes` of a donor's KV pool region (any donor shape: a chunk is
  bytes of one donor layer's K or V rows, cut from the donor pages the lease grants).

Attention reads and writes those rows where they are mapped: nothing is copied per forward, no
layer is staged, and the pool holds local R + every leased row (at equal memory, a stock pool's
tokens plus the loan). Pieces move only between forwards, under the pool's forward lock:

- `place()` (each scheduler step, and at a grant): a piece on host memory whose lease has a free
  chunk is copied into the chunk, then its addresses are remapped onto the chunk;
- `fence(lease, donor_pages)` (a reclaim, on the control agent's thread) and `drop(lease)` (a
  lost lease): every piece on a chunk the pages touch is copied back to its host backing and
  remapped there before the call returns, so the reclaim may be acknowledged then. Nothing is
  lost and no request is recomputed: the donor's memory stays valid until the ack (a dead
  donor's shared memory lives while it is mapped);
- before each forward (`begin_layer_stream`), a lease whose read deadline is nearer than
  `READ_GUARD_S` leaves the same way (the donor still vouches for its bytes until the deadline).

Host memory holds a backing piece for every mapped piece (as the host store of the other
depths does), so a piece can always leave its donor. On CPU the pieces are ranges of a memfd
(local rows and host backing) or of the donor's POSIX shared memory, mapped with
`mmap(MAP_FIXED | MAP_SHARED)`. CUDA needs the donor's pool exported as virtual memory
allocations a peer can map; this version refuses depth 0 on CUDA (`MappedKVPool` says so).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from swift_kernels import K, KVGeometry, V
from swift_kernels.geometry import dtype_name

from ..dataplane.sharing import HEADER_BYTES
from .layer_views import _MAP_FAILED, _PROT_NONE, _PROT_RW, _libc

logger = logging.getLogger(__name__)

PIECE_BYTES = 64 << 10  # CPU: at least this much per mapped piece (fewer mappings per layer)
READ_GUARD_S = 2.0  # a lease this near its read deadline leaves before the next forward
FREE, GONE = -1, -2  # a chunk holding no piece; a chunk the donor took back
_MAP_FIXED = 0x10


def piece_bytes_for(row_bytes: int, granularity: int = mmap.PAGESIZE,
                    at_least: int = PIECE_BYTES) -> int:
    """The bytes of one mapped piece: a multiple of the granularity and of one row, at least
    `at_least`."""
    unit = row_bytes * granularity // math.gcd(row_bytes, granularity)
    return unit * max(1, -(-at_least // unit))


def mapped_rows(tokens: int, page_size: int, resident_fraction: float, row_bytes: int,
                piece_bytes: int, granularity: int = mmap.PAGESIZE) -> tuple[int, int]:
    """(R, rows) of a depth-0 pool of `tokens` slots: R local rows (the resident fraction of the
    tokens, rounded down to whole pages and mapping units) and the rows of each layer's buffer,
    R plus whole pieces covering the slots SGLang uses (tokens + one page)."""
    unit = granularity // math.gcd(granularity, row_bytes)
    step = unit * page_size // math.gcd(unit, page_size)
    resident = int(resident_fraction * tokens) // step * step
    per = piece_bytes // row_bytes
    pieces = -(-(tokens + page_size - resident) // per)
    return resident, resident + pieces * per


# ---- donor chunks --------------------------------------------------------------------------------
@dataclass(frozen=True)
class DonorChunks:
    """The chunks cut from a lease's donor pages: chunk c is `piece_bytes` at `offset[c]` of the
    donor's region (after its header), inside one donor layer's K or V rows, and touches the
    donor pages `first[c]` .. `last[c]` (one layer's rows of them)."""

    offset: np.ndarray
    first: np.ndarray
    last: np.ndarray

    def __len__(self) -> int:
        return int(self.offset.size)

    @classmethod
    def cut(cls, layout: Any, pages, piece_bytes: int, align: int = mmap.PAGESIZE,
            header: int = HEADER_BYTES) -> "DonorChunks":
        """Every whole chunk inside the runs of consecutive `pages` of each donor layer's K and
        V rows, starting at an `align`-aligned offset of the region's file (`header` bytes
        precede the region there)."""
        pages = np.unique(np.asarray(list(pages), dtype=np.int64))
        if pages.size == 0:
            return cls(*(np.zeros(0, dtype=np.int64) for _ in range(3)))
        breaks = np.nonzero(np.diff(pages) != 1)[0] + 1
        runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(pages, breaks)]
        offsets, firsts, lasts = [], [], []
        for layer in range(layout.geometry.num_layers):
            for half in (K, V):
                per_page = layout.chunk_bytes(half)
                if per_page == 0:  # a latent pool has no V rows
                    continue
                for a, b in runs:
                    lo = layout.chunk_offset(a, layer, half)
                    hi = lo + (b - a) * per_page
                    start = -(-(lo + header) // align) * align - header
                    n = max(0, (hi - start) // piece_bytes)
                    at = start + piece_bytes * np.arange(n, dtype=np.int64)
                    offsets.append(at)
                    firsts.append(a + (at - lo) // per_page)
                    lasts.append(a + (at + piece_bytes - 1 - lo) // per_page)
        cat = [np.concatenate(x) if x else np.zeros(0, dtype=np.int64)
               for x in (offsets, firsts, lasts)]
        return cls(*cat)

    def touching(self, pages) -> np.ndarray:
        """Indices of the chunks that touch any of `pages`."""
        pages = np.unique(np.asarray(list(pages), dtype=np.int64))
        if pages.size == 0 or len(self) == 0:
            return np.zeros(0, dtype=np.int64)
        at = np.searchsorted(pages, self.first)
        inside = at < pages.size
        hit = np.zeros(len(self), dtype=bool)
        hit[inside] = pages[at[inside]] <= self.last[inside]
        return np.nonzero(hit)[0]


class MappedLease:
    """One lease's chunks in a `MappedRows`: `piece[c]` is the piece on chunk c, FREE or GONE.
    `region` is the donor's region (a uint8 tensor, after the header), `open_fd()` opens its
    file for mapping, `readable()` says whether the lease may be read now and
    `deadline()` until when (CLOCK_MONOTONIC)."""

    def __init__(self, number: int, key: Any, chunks: DonorChunks, region: torch.Tensor,
                 open_fd: Callable[[], int], readable: Callable[[], bool],
                 deadline: Callable[[], float]):
        self.number, self.key, self.chunks, self.region = number, key, chunks, region
        self.open_fd, self.readable, self.deadline = open_fd, readable, deadline
        self.mapping: Any = None  # the runtime's name for the donor mapping the region is in
        self.piece = np.full(len(chunks), FREE, dtype=np.int64)

    @property
    def held(self) -> int:
        """Chunks the donor has not taken back."""
        return int((self.piece != GONE).sum())


# ---- the pieces ----------------------------------------------------------------------------------
class MappedRows:
    """Every layer's rows of a depth-0 pool and where each piece of them is mapped (see the
    module docstring). `views[l]` is layer l's `(2, rows, *row_shape)` buffer."""

    tier = "donor"
    where = "donor memory under a lease, read in place (host memory where no lease holds it)"

    def __init__(self, layers: int, resident: int, rows: int, row_shape: tuple[int, ...],
                 dtype: torch.dtype, page_size: int, piece_bytes: int):
        elem = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = math.prod(row_shape) * elem
        gran = mmap.PAGESIZE
        if piece_bytes % gran or piece_bytes % self.row_bytes:
            raise ValueError(f"a piece of {piece_bytes} bytes is not a multiple of the mapping "
                             f"granularity {gran} and of a row of {self.row_bytes} bytes")
        if resident * self.row_bytes % gran or (rows - resident) * self.row_bytes % piece_bytes:
            raise ValueError(f"{resident} local rows and {rows - resident} mapped rows do not "
                             f"fill whole mapping units; use mapped_rows")
        self.layers, self.resident, self.rows = layers, resident, rows
        self.piece_bytes = piece_bytes
        self.per_piece = piece_bytes // self.row_bytes
        self.pieces_per_half = (rows - resident) // self.per_piece
        self.num_pieces = layers * 2 * self.pieces_per_half
        self.geometry = KVGeometry(layers, row_shape[0], row_shape[1], row_shape[1],
                                   dtype_name(dtype), page_size)
        self.lock = threading.RLock()  # held by a forward, and by every remap
        self._libc = _libc()
        self._fd = os.memfd_create("swiftcache-mapped-kv", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self._fd)
        local = layers * 2 * resident * self.row_bytes
        self._host_at = local  # the host backing follows the local rows in the memfd
        self.local_bytes = local
        self.nbytes = self.num_pieces * piece_bytes  # host memory: one backing per piece
        os.ftruncate(self._fd, local + self.nbytes)
        home = mmap.mmap(self._fd, local + self.nbytes)
        self._home = torch.frombuffer(home, dtype=torch.uint8)  # every local and host byte
        self._bases: list[int] = []
        self.views = []
        half_bytes = rows * self.row_bytes
        for layer in range(layers):
            base = self._reserve(2 * half_bytes)
            for half in (K, V):
                if resident:
                    self._map(base + half * half_bytes, resident * self.row_bytes, self._fd,
                              (layer * 2 + half) * resident * self.row_bytes)
                for p in range(self.pieces_per_half):
                    q = self._piece(layer, half, p)
                    self._map(self._address(q, base), piece_bytes, self._fd, self._host(q))
            buf = (ctypes.c_uint8 * (2 * half_bytes)).from_address(base)
            weakref.finalize(buf, self._libc.munmap, base, 2 * half_bytes)
            self.views.append(torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
                              .view(2, rows, *row_shape))
            self._bases.append(base)
        # where each piece is: the lease number and chunk holding it, or -1 (host backing)
        self.on_lease = np.full(self.num_pieces, -1, dtype=np.int64)
        self.on_chunk = np.full(self.num_pieces, -1, dtype=np.int64)
        # placement order: whole rows first (every layer's piece p before any piece p + 1), so
        # the lowest slots, which the allocator hands out first, are the first on donors
        p_major = np.arange(self.num_pieces).reshape(layers * 2, -1).T.reshape(-1)
        self._order = p_major
        self.leases: dict[int, MappedLease] = {}
        self._numbers = 0
        self.pieces_flipped = 0
        self.bytes_to_donor = self.bytes_to_host = 0

    # ---- addresses -----------------------------------------------------------------------------
    def _piece(self, layer: int, half: int, p: int) -> int:
        return (layer * 2 + half) * self.pieces_per_half + p

    def _address(self, q: int, base: int | None = None) -> int:
        lh, p = divmod(q, self.pieces_per_half)
        layer, half = divmod(lh, 2)
        base = self._bases[layer] if base is None else base
        return base + (half * self.rows + self.resident + p * self.per_piece) * self.row_bytes

    def _host(self, q: int) -> int:
        return self._host_at + q * self.piece_bytes

    def _reserve(self, nbytes: int) -> int:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        base = self._libc.mmap(None, nbytes, _PROT_NONE, flags, -1, 0)
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"cannot reserve {nbytes} bytes of address space")
        return base

    def _map(self, at: int, nbytes: int, fd: int, offset: int) -> None:
        got = self._libc.mmap(at, nbytes, _PROT_RW, mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
        if got != at:
            raise OSError(ctypes.get_errno(), f"cannot map {nbytes} bytes of KV at {at:#x}")

    # ---- what the logs and the leases read ------------------------------------------------------
    @property
    def pieces_on_donor(self) -> int:
        return int((self.on_lease >= 0).sum())

    def rows_on_donor(self) -> int:
        return self.pieces_on_donor * self.per_piece

    # ---- leases --------------------------------------------------------------------------------
    def add_lease(self, key: Any, chunks: DonorChunks, region: torch.Tensor,
                  open_fd: Callable[[], int], readable: Callable[[], bool],
                  deadline: Callable[[], float]) -> MappedLease:
        if len(chunks) and int(chunks.offset.max()) + self.piece_bytes > region.numel():
            raise ValueError(f"a chunk ends past the donor's region of {region.numel()} bytes")
        with self.lock:
            lease = MappedLease(self._numbers, key, chunks, region, open_fd, readable, deadline)
            self.leases[lease.number] = lease
            self._numbers += 1
        return lease

    def place(self) -> int:
        """Host pieces onto free chunks of readable leases (lowest rows first), each copied in
        before its addresses move there. Returns the pieces placed."""
        todo = [lease for lease in self.leases.values() if bool((lease.piece == FREE).any())]
        if not todo or self.pieces_on_donor >= self.num_pieces:
            return 0
        placed = 0
        with self.lock:
            for lease in todo:
                if (self.leases.get(lease.number) is not lease or not lease.readable()
                        or lease.deadline() - time.monotonic() < READ_GUARD_S):
                    continue
                on_host = self._order[self.on_lease[self._order] < 0]
                free = np.nonzero(lease.piece == FREE)[0]
                n = min(on_host.size, free.size)
                if n == 0:
                    continue
                fd = lease.open_fd()
                try:
                    for q, c in zip(on_host[:n].tolist(), free[:n].tolist()):
                        off = int(lease.chunks.offset[c])
                        lease.region[off: off + self.piece_bytes].copy_(
                            self._home[self._host(q): self._host(q) + self.piece_bytes])
                        self._map(self._address(q), self.piece_bytes, fd, HEADER_BYTES + off)
                        self.on_lease[q], self.on_chunk[q] = lease.number, c
                        lease.piece[c] = q
                finally:
                    os.close(fd)
                placed += n
                self.bytes_to_donor += n * self.piece_bytes
        return placed

    def fence(self, lease: MappedLease, donor_pages) -> int:
        """The donor takes back `donor_pages` of `lease`: the pieces on chunks they touch go back
        to host memory (copied, remapped) before this returns. Returns the pieces moved."""
        chunks = lease.chunks.touching(donor_pages)
        with self.lock:
            return self._unplace(lease, chunks, GONE)

    def drop(self, lease: MappedLease) -> int:
        """The lease is over (lost, or the pool closes): all its pieces go back to host memory."""
        with self.lock:
            moved = self._unplace(lease, np.arange(len(lease.chunks)), GONE)
            self.leases.pop(lease.number, None)
        return moved

    def leave_if_due(self, now: float | None = None) -> int:
        """Before a forward, under the lock: a lease past its read deadline, or nearer to it than
        READ_GUARD_S, or found unreadable, gives its pieces back to host memory (they are placed
        again once it reads again). Returns the pieces moved."""
        now = time.monotonic() if now is None else now
        moved = 0
        for lease in list(self.leases.values()):
            if not bool((lease.piece >= 0).any()):
                continue
            if lease.deadline() - now < READ_GUARD_S or not lease.readable():
                moved += self._unplace(lease, np.arange(len(lease.chunks)), FREE)
        return moved

    def _unplace(self, lease: MappedLease, chunks: np.ndarray, mark: int) -> int:
        """Under the lock: the pieces on `chunks` of `lease` go back to their host backing."""
        moved = 0
        for c in np.asarray(chunks, dtype=np.int64).tolist():
            q = int(lease.piece[c])
            if q >= 0:
                off = int(lease.chunks.offset[c])
                self._home[self._host(q): self._host(q) + self.piece_bytes].copy_(
                    lease.region[off: off + self.piece_bytes])
                self._map(self._address(q), self.piece_bytes, self._fd, self._host(q))
                self.on_lease[q] = self.on_chunk[q] = -1
                moved += 1
            if lease.piece[c] != GONE:
                lease.piece[c] = mark
        self.pieces_flipped += moved
        self.bytes_to_host += moved * self.piece_bytes
        return moved


class MappedKVPool(MHATokenToKVPool):
    """SGLang's MHA pool over `MappedRows` (see the module docstring). Build with
    `MappedKVPool.configured(settings)(...)`, with MHATokenToKVPool's own arguments; the
    settings' depth is 0 and its resident fraction the local part of the tokens."""

    settings: Any = None
    piece_at_least = PIECE_BYTES  # the smallest piece; a mapped piece is whole rows and pages
    _configured: dict = {}

    @classmethod
    def configured(cls, settings: Any) -> type:
        if settings not in cls._configured:
            cls._configured[settings] = type(cls.__name__, (cls,), {
                "settings": settings, "__module__": cls.__module__})
        return cls._configured[settings]

    def _create_buffers_normal(self) -> None:
        if torch.device(self.device).type != "cpu":
            raise ValueError(
                "SwiftCache layer stream depth 0 (KV read in place from donor pages) maps the "
                "donor's pool into this pool's addresses; on CUDA that needs the donor's pool "
                "exported as virtual memory allocations, which this version does not do. Use "
                "--swiftcache-layer-stream-depth 2 or more on a GPU.")
        if self.kv_cache_layout != "nhd" or self.use_hnd:
            raise ValueError(f"SwiftCache layer stream depth 0 maps NHD rows; this pool's layout "
                             f"is {self.kv_cache_layout!r}")
        (rows, *row_shape), (_, *v_shape) = self._kv_buffer_shapes()
        if row_shape != v_shape:
            raise ValueError(f"SwiftCache layer stream depth 0 needs K and V rows of one shape "
                             f"({row_shape} vs {v_shape})")
        row_bytes = int(torch.empty(row_shape, dtype=self.store_dtype).nbytes)
        piece = piece_bytes_for(row_bytes, at_least=self.piece_at_least)
        resident, padded = mapped_rows(self.size, self.page_size,
                                       self.settings.resident_fraction, row_bytes, piece)
        self.layer_store = MappedRows(self.layer_num, resident, padded, tuple(row_shape),
                                      self.store_dtype, self.page_size, piece)
        self.resident_rows = resident
        self.k_buffer = [buf[0, :rows] for buf in self.layer_store.views]
        self.v_buffer = [buf[1, :rows] for buf in self.layer_store.views]
        self.forwards = 0
        self.pieces_left_before_forward = 0
        logger.info("SwiftCache layer streaming: KV pool of %d tokens read in place; %d resident "
                    "tokens local (%.1f MiB), %d rows per layer in %d pieces of %d KiB on donor "
                    "memory or host memory (%.1f MiB of host backing)", self.size, resident,
                    self.layer_store.local_bytes / 2**20, padded - resident,
                    self.layer_store.pieces_per_half, piece >> 10,
                    self.layer_store.nbytes / 2**20)

    def local_kv_bytes(self) -> int:
        return self.layer_store.local_bytes

    def get_kv_size_bytes(self):
        half = self.local_kv_bytes() // 2
        return half, half

    def _clear_buffers(self):
        super()._clear_buffers()
        self.layer_store = None

    # ---- one forward: the pieces stay where they are until it ends ----------------------------
    def begin_layer_stream(self, forward_batch, req_to_token: torch.Tensor) -> None:
        store = self.layer_store
        store.lock.acquire()
        try:
            self.forwards += 1
            self.pieces_left_before_forward += store.leave_if_due()
        except BaseException:
            store.lock.release()
            raise

    def end_layer_stream(self) -> None:
        self.layer_store.lock.release()

    # ---- host-side readers and writers SGLang calls between forwards -----------------------------
    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        with self.layer_store.lock:
            return super().move_kv_cache(tgt_loc, src_loc)

    def get_cpu_copy(self, *args, **kwargs):
        with self.layer_store.lock:
            return super().get_cpu_copy(*args, **kwargs)

    def load_cpu_copy(self, *args, **kwargs):
        with self.layer_store.lock:
            return super().load_cpu_copy(*args, **kwargs)

    def stream_stats(self) -> dict:
        store = self.layer_store
        return {"forwards": self.forwards, "rows_loaded": 0, "rows_saved": 0, "copy_s": 0.0,
                "local_kv_bytes": self.local_kv_bytes(), "store_bytes": store.nbytes,
                "resident_rows": self.resident_rows, "rows_from_donor": 0,
                "pages_on_donor": store.pieces_on_donor}
