"""`MappedLeases`: the borrower side of a depth-0 pool (`mapped.py`): leases of donor pool pages
whose bytes the pool maps in place of its host pieces.

It is `StoreLeases` (hence `Borrowing`: asking up to a limit, backing off, mapping each donor's
pool once, unlinking a dead donor's shared memory) counting pieces instead of store pages:
- a grant's pages are cut into chunks (`DonorChunks.cut`: whole pieces of one donor layer's K or
  V rows, any donor shape) and the pool's host pieces are placed on them (`MappedRows.place`);
- a reclaim moves the pieces on the chunks the reclaimed pages touch back to host memory
  (`fence`, on the agent's thread as the reclaim arrives; the ack leaves when it returns);
- a lost lease moves all its pieces back (`drop`); nothing is lost, nothing is recomputed.
The request counts donor pages: the chunks missing, plus one chunk's pages per donor layer half
for the alignment a run of pages may lose at its ends.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..control import LeaseGranted
from ..dataplane import MappingError
from ..dataplane.borrowing import Borrowing
from .mapped import DonorChunks, MappedRows
from .store_leases import StoreLeases

logger = logging.getLogger(__name__)
STATS = ("stream_pieces_on_donor", "stream_pieces_flipped", "stream_bytes_to_donor",
         "stream_bytes_to_host")


def _shm_opener(descriptor: Any):
    """A function opening the donor region's shared memory for mapping (CPU: its name)."""
    kind = descriptor.get("kind") if isinstance(descriptor, dict) else descriptor.kind
    handle = (descriptor.get("handle") if isinstance(descriptor, dict)
              else descriptor.handle)
    if kind != "shm":
        raise MappingError("unsupported", f"a {kind} region cannot be mapped in place here")
    name = "/" + bytes(handle).decode().lstrip("/")

    def open_fd() -> int:
        import _posixshmem

        try:
            return _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
        except FileNotFoundError as e:
            raise MappingError("not_found", f"shared memory {name!r} is gone") from e

    return open_fd


class MappedLeases(StoreLeases):
    """Leases for a depth-0 pool's pieces; built by `StoreLeases.for_pool`."""

    UNITS, FALLBACK = "pieces", "read from host memory"

    def __init__(self, store: MappedRows, *, kv_pool: Any, agent: Any, stats: dict) -> None:
        Borrowing.__init__(self, max_blocks=store.num_pieces, geometry=store.geometry,
                           kv_pool=kv_pool, agent=agent, stats=stats)
        self.store = store
        stats.update({k: 0 for k in STATS})

    def held_tokens(self) -> int:
        """Tokens of this model's KV the held chunks can hold (every layer's K and V)."""
        return self.held_blocks * self.store.per_piece // (2 * self.store.layers)

    def _pages_for(self, layout: Any, donor_ranks: int, want: int) -> int:
        """Donor pages for `want` chunks, with one chunk's pages per donor layer half of slack."""
        halves = [h for h in (0, 1) if layout.chunk_bytes(h)]
        per_page = layout.geometry.num_layers * sum(layout.chunk_bytes(h) for h in halves)
        slack = max(-(-self.store.piece_bytes // layout.chunk_bytes(h)) for h in halves)
        return -(-want * self.store.piece_bytes // per_page) + slack + 1

    def maybe_request(self, peers_present: bool) -> None:
        store = self.store
        placed = store.place()
        if placed:
            logger.info("SwiftCache layer streaming: %d more pieces read in place from donor "
                        "memory (%d of %d)", placed, store.pieces_on_donor, store.num_pieces)
        self.stats.update(stream_pieces_on_donor=store.pieces_on_donor,
                          stream_pieces_flipped=store.pieces_flipped,
                          stream_bytes_to_donor=store.bytes_to_donor,
                          stream_bytes_to_host=store.bytes_to_host)
        Borrowing.maybe_request(self, peers_present)

    def on_granted(self, ev: LeaseGranted, tree: Any) -> None:
        self._pending = False
        donor, lease_id = ev.key.donor, ev.key.lease_id
        try:
            mapped = self._map(ev.memory)
            open_fd = _shm_opener(mapped.arena.descriptor)
            chunks = DonorChunks.cut(mapped.layout, ev.blocks, self.store.piece_bytes)
            if len(chunks) == 0:
                raise ValueError(f"{len(ev.blocks)} donor pages hold no whole piece of "
                                 f"{self.store.piece_bytes} bytes")
        except (MappingError, ValueError) as exc:  # expected: give the pages back, run on host
            logger.warning("SwiftCache: cannot map the lease from %s in place (%s); releasing "
                           "it", donor, exc)
            self.agent.release(ev.key)
            self.on_failed(donor, "unusable grant")
            return
        self._failures = 0
        self._layouts[donor] = mapped.layout
        readable = self._readable(donor, lease_id, mapped)

        def deadline() -> float:
            return self.agent.read_deadline(donor, lease_id)

        lease = self.store.add_lease(ev.key, chunks, mapped.region, open_fd, readable, deadline)
        lease.mapping = ev.memory.owner_uuid
        self.leases[(donor, lease_id)] = lease
        self.stats["leases"] += 1
        logger.info("SwiftCache layer streaming: borrowing %d pages of %s's pool as %d chunks "
                    "read in place (lease %d, epoch %d)", len(ev.blocks), donor, len(chunks),
                    lease_id, ev.key.epoch)
        self.maybe_request(False)
