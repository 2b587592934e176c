"""`DonorLayerStore`: a streamed pool's rows in pages of donors' KV pools, backed by host memory.

It has `HostLayerStore`'s interface (`load` / `save` per layer, the host-side `read_rows` /
`write_rows` / `move_rows`), so `pool.py` is the same for both tiers. Rows keep the pool's slot
numbering and are grouped in **store pages** of `page_size` slots; a store page is one block of
this model (every layer, K and V: the pool's `KVGeometry`), and a donor lease holds
`LeasePacking.num_blocks` of them laid over the donor's pages, whatever the donor's shape.
Leases come from the runtime (`store_leases.py`): `add_lease`, then `place()` fills the lease's
blocks with store pages not on any lease yet.

Fault design: nothing is ever lost, so no request is aborted or recomputed.
- Every write goes to the host backing and, for a page placed on a lease, through to its block:
  the host backing always holds every row, and a block every row of the page placed on it.
- A read takes the rows of placed pages from the donor (unit-row copies straight out of the
  mapped region: peer HBM, over NVLink on a GPU) and the rest from the host backing.
- A page leaves its lease ("flips to host") when the donor reclaims pages under its block
  (`fence`), when the lease is lost (`drop`), or when a copy finds the lease unreadable (donor
  process gone, read deadline passed); its reads come from host from then on. `fence` returns only
  once no copy reads the fenced blocks (CPU: the lock every donor copy holds; GPU: the copy lane
  drained), so the reclaim may be acknowledged then.
- A page placed on a block is first copied host -> donor for every layer, under the same lock, so
  a block is complete before anything reads it; a lease made unreadable is placed again (copied
  again) once it reads again.
Cost: host memory for the whole store (as the host tier) and a second write of each new token's
K and V. Gain: the reads, the dominant traffic (every layer's prefix at every step), come from
donor memory (docs/layer_stream.md "Streaming from a donor").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from swift_kernels import K, KVGeometry, V
from swift_kernels.geometry import dtype_name

from ..dataplane.packing import LeasePacking
from .donor_lease import FREE, GONE, DonorLease, LeaseCopy
from .slots import SlotSet
from .store import CopyLane, HostLayerStore

STAGING_BYTES = 2 << 20  # CPU row copies go through this reused buffer (as pool leases' do)


@dataclass(frozen=True)
class _Split:
    """A slot set divided by where its pages live now (valid while `version` is current)."""

    slots: SlotSet
    version: int
    host: SlotSet
    donor: tuple[LeaseCopy, ...]


class DonorLayerStore:
    """See the module docstring. `host` is the backing (every row), `lane` the pool's copy lane,
    `max_runs` the pool's runs-versus-index threshold."""

    tier = "donor"
    where = "donor memory under a lease, written through to host memory"

    def __init__(self, host: HostLayerStore, page_size: int, lane: CopyLane, max_runs: int,
                 first_row: int = 0):
        layers, _, rows, heads, dim = host.data.shape
        if first_row % page_size:
            raise ValueError(f"the first streamed row {first_row} is not a page boundary "
                             f"(page size {page_size})")
        self.host, self.lane, self.max_runs, self.device = host, lane, max_runs, host.device
        self.geometry = KVGeometry(layers, heads, dim, dim, dtype_name(host.data.dtype),
                                   page_size)
        # Pages below first_page hold the pool's resident rows, which never stream: only the
        # num_pages from there (whole pages; a partial tail page stays on host) are placed.
        self.first_page = first_row // page_size
        self.num_pages = rows // page_size - self.first_page
        self._owner = torch.full((-(-rows // page_size),), FREE, dtype=torch.int64)  # lease no.
        self._block = torch.zeros_like(self._owner)  # the page's block in that lease
        self.leases: dict[int, DonorLease] = {}
        self._numbers = 0
        self._lock = threading.Lock()  # held by every donor copy and every change of placement
        self._version = 0  # bumped on every change of placement: splits made before are stale
        self._splits: dict[int, _Split] = {}
        self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8)
        self.rows_from_donor = self.rows_to_donor = self.pages_flipped = 0

    # ---- what the pool and the logs read ------------------------------------------------------
    @property
    def data(self) -> torch.Tensor:
        return self.host.data

    @property
    def nbytes(self) -> int:
        """Host memory held: the backing, the whole store."""
        return self.host.nbytes

    @property
    def rows_loaded(self) -> int:
        return self.host.rows_loaded + self.rows_from_donor

    @property
    def rows_saved(self) -> int:
        return self.host.rows_saved

    @property
    def pages_on_donor(self) -> int:
        return int((self._owner >= 0).sum())

    # ---- leases (runtime thread) --------------------------------------------------------------
    def add_lease(self, key: Any, packing: LeasePacking, region: torch.Tensor,
                  readable: Callable[[], bool]) -> DonorLease:
        """A lease's blocks join the store (none placed yet: call `place`)."""
        if packing.borrower != self.geometry:
            raise ValueError(f"a lease packed for {packing.borrower} cannot hold this store's "
                             f"pages of {self.geometry}")
        with self._lock:
            lease = DonorLease(self._numbers, key, self.geometry, packing, region, readable)
            self.leases[lease.number] = lease
            self._numbers += 1
        return lease

    def place(self) -> int:
        """Put store pages not on any lease onto free blocks of readable leases, each copied
        host -> donor (every layer) before it is read from there. Returns the pages placed."""
        todo = [n for n, lease in self.leases.items() if bool((lease.pages == FREE).any())]
        if not todo or self.pages_on_donor >= self.num_pages:
            return 0
        self.lane.drain()  # write-throughs still queued into host rows land first
        placed = 0
        with self._lock:
            end = self.first_page + self.num_pages
            unplaced = torch.nonzero(self._owner[self.first_page: end] == FREE).flatten() \
                + self.first_page
            for number in todo:
                lease = self.leases.get(number)
                if lease is None or placed >= unplaced.numel() or not lease.readable():
                    continue
                blocks = torch.nonzero(lease.pages == FREE).flatten()
                pages = unplaced[placed: placed + blocks.numel()]
                blocks = blocks[: pages.numel()]
                P = self.geometry.page_size
                slots = (pages[:, None] * P + torch.arange(P)).reshape(-1)
                copy = LeaseCopy.of(lease, slots, blocks.repeat_interleave(P), P, self.device)
                for layer in range(self.geometry.num_layers):
                    copy.run(layer, self.host.data[layer, K], self.host.data[layer, V], True,
                             self._staging)
                self._owner[pages], self._block[pages] = number, blocks
                lease.pages[blocks] = pages
                placed += pages.numel()
            self._version += 1
        return placed

    def fence(self, lease: DonorLease, donor_pages) -> int:
        """The donor takes back `donor_pages` of `lease`: the store pages on the blocks they
        touch flip to host. Returns once no copy reads those blocks; the pages flipped."""
        blocks = torch.tensor(lease.packing.blocks_touching(donor_pages, strict=False),
                              dtype=torch.int64)
        with self._lock:
            flipped = self._unplace(lease, blocks, GONE)
        self.lane.drain()
        return flipped

    def drop(self, lease: DonorLease) -> int:
        """The lease is over (lost, or the store closes): all its pages flip to host."""
        with self._lock:
            flipped = self._unplace(lease, torch.arange(lease.packing.num_blocks), GONE)
            self.leases.pop(lease.number, None)
        self.lane.drain()
        return flipped

    def _unplace(self, lease: DonorLease, blocks: torch.Tensor, mark: int) -> int:
        """Under the lock: the pages on `blocks` go back to host; the blocks become `mark`."""
        if mark == FREE:
            blocks = blocks[lease.pages[blocks] != GONE]
        pages = lease.pages[blocks]
        pages = pages[pages >= 0]
        self._owner[pages] = FREE
        lease.pages[blocks] = mark
        self.pages_flipped += pages.numel()
        self._version += 1
        return int(pages.numel())

    # ---- copies (inside CopyLane.run) ---------------------------------------------------------
    def load(self, layer: int, slots: SlotSet, stage: torch.Tensor) -> None:
        """stage[:, s] = row s of `layer` for s in `slots`: from its block if its page is
        placed on a readable lease, else from the host backing."""
        split = self._donor_copies(layer, slots, stage[K], stage[V], to_donor=False)
        self.host.load(layer, split.host, stage)

    def save(self, layer: int, slots: SlotSet, stage: torch.Tensor) -> None:
        """Write-through of `stage`'s rows at `slots`: to the host backing, and to the blocks of
        the placed pages among them."""
        self.host.save(layer, slots, stage)
        self._donor_copies(layer, slots, stage[K], stage[V], to_donor=True)

    def _donor_copies(self, layer: int, slots: SlotSet, k: torch.Tensor, v: torch.Tensor,
                      to_donor: bool) -> _Split:
        """Copy the placed part of `slots` between `k` / `v` and the donors; the split used (its
        `host` part is what the donors did not serve). A lease found unreadable flips first."""
        with self._lock:
            while True:
                split = self._split(slots)
                bad = [part.lease for part in split.donor if not part.lease.readable()]
                if not bad:
                    break
                for lease in bad:  # placed again by `place` once it reads again
                    self._unplace(lease, torch.arange(lease.packing.num_blocks), FREE)
            for part in split.donor:
                part.run(layer, k, v, to_donor, self._staging)
                if to_donor:
                    self.rows_to_donor += part.count
                else:
                    self.rows_from_donor += part.count
        return split

    def _split(self, slots: SlotSet) -> _Split:
        """Under the lock: `slots` divided into the host part and one part per lease."""
        memo = self._splits.get(id(slots))
        if memo is not None and memo.slots is slots and memo.version == self._version:
            return memo
        if len(self._splits) >= 8:
            self._splits.clear()
        split = _Split(slots, self._version, slots, ())
        if slots.count and bool((self._owner >= 0).any()):
            idx = slots.as_index()
            page = idx // self.geometry.page_size
            owner = self._owner[page]
            on_host = owner < 0
            host = slots if bool(on_host.all()) else SlotSet.of(idx[on_host], self.max_runs)
            parts = tuple(LeaseCopy.of(self.leases[n], idx[owner == n],
                                       self._block[page[owner == n]], self.geometry.page_size,
                                       self.device)
                          for n in torch.unique(owner[~on_host]).tolist())
            split = _Split(slots, self._version, host, parts)
        self._splits[id(slots)] = split
        return split

    # ---- whole-slot operations SGLang asks the pool for (host side, after a drain) -------------
    def read_rows(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.host.read_rows(layer, index)

    def write_rows(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.host.write_rows(layer, index, k, v)
        self._write_back(index, (layer,))

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.host.move_rows(dst, src)
        self._write_back(dst, range(self.geometry.num_layers))

    def _write_back(self, index: torch.Tensor, layers) -> None:
        """Rows written into the host backing directly go to their blocks too."""
        slots = SlotSet.of(index, self.max_runs)
        for layer in layers:
            self._donor_copies(layer, slots, self.host.data[layer, K], self.host.data[layer, V],
                               to_donor=True)

