"""`StoreLeases`: the borrower side of a server streaming from donors (`--swiftcache-layer-stream
donor`): leases of donor pool pages for its streamed pool's store, not for its radix tree.

It is `dataplane.borrowing.Borrowing` (asking for leases up to a limit, backing off after a
refusal, mapping each donor's pool once, unlinking a dead donor's shared memory) with the lease
events going to a `DonorLayerStore` instead of the tree's donor tier, which this mode does not
have:
- a grant is packed for this model's shape (`LeasePacking`) and its blocks filled with store
  pages (`DonorLayerStore.place`, which copies each page in before anything reads it there);
- a reclaim flips the pages on the reclaimed blocks to host memory and returns once no copy reads
  them (`fence` -> `DonorLayerStore.fence`, which the runtime calls on the control agent's thread
  as the reclaim arrives, then acknowledges). Nothing is lost: every row is also in the host
  backing, so no request is aborted or recomputed;
- a lost lease flips all its pages to host the same way;
- each scheduler step (`maybe_request`) places pages again (a lease that was unreadable for a
  while, store pages whose lease was reclaimed once a new grant arrives) and asks for the blocks
  missing: the limit is the store's pages, so while no lease is held the server streams from host.
The runtime hands these events over exactly as to `Borrowing` (`SwiftRuntime.borrowing`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..control import LeaseGranted, LeaseLost, ReclaimRequested
from ..dataplane import LeasePacking, MappingError, owner_alive
from ..dataplane.borrowing import Borrowing
from .donor_store import DonorLayerStore

logger = logging.getLogger(__name__)
LIVENESS_CHECK_S = 0.05  # how often a copy may look for the donor's process (a syscall)
STATS = ("stream_pages_on_donor", "stream_rows_from_donor", "stream_rows_to_donor",
         "stream_pages_flipped")


class StoreLeases(Borrowing):
    """Leases for `store`'s pages; built by the runtime with `StoreLeases.for_pool`."""

    UNITS, FALLBACK = "store pages", "stream from host memory"  # what moves, and where to

    def __init__(self, store: DonorLayerStore, *, kv_pool: Any, agent: Any,
                 stats: dict) -> None:
        super().__init__(max_blocks=store.num_pages, geometry=store.geometry, kv_pool=kv_pool,
                         agent=agent, stats=stats)
        self.store = store
        stats.update({k: 0 for k in STATS})

    @classmethod
    def for_pool(cls, kv_pool: Any, **kwargs: Any) -> "StoreLeases":
        store = getattr(kv_pool, "layer_store", None)
        from .mapped import MappedRows

        if isinstance(store, MappedRows):  # depth 0: the pool's pieces, read in place
            from .mapped_leases import MappedLeases

            return MappedLeases(store, kv_pool=kv_pool, **kwargs)
        if not isinstance(store, DonorLayerStore):
            raise ValueError("--swiftcache-layer-stream donor needs the layer-stream KV pool with "
                             f"a donor store; this server's pool is {type(kv_pool).__name__} "
                             f"with {type(store).__name__}")
        return cls(store, kv_pool=kv_pool, **kwargs)

    # ---- one scheduler step -------------------------------------------------------------------
    def maybe_request(self, peers_present: bool) -> None:
        placed = self.store.place()
        if placed:
            logger.info("SwiftCache layer streaming: %d more store pages stream from donor "
                        "memory (%d of %d)", placed, self.store.pages_on_donor,
                        self.store.num_pages)
        store = self.store
        self.stats.update(stream_pages_on_donor=store.pages_on_donor,
                          stream_rows_from_donor=store.rows_from_donor,
                          stream_rows_to_donor=store.rows_to_donor,
                          stream_pages_flipped=store.pages_flipped)
        super().maybe_request(peers_present)

    # ---- lease events (the tree is not involved: it has no donor tier here) ---------------------
    def on_granted(self, ev: LeaseGranted, tree: Any) -> None:
        self._pending = False
        donor, lease_id = ev.key.donor, ev.key.lease_id
        try:
            mapped = self._map(ev.memory)
            packing = LeasePacking(self.geometry, mapped.layout, list(ev.blocks))
            if packing.num_blocks == 0:
                raise ValueError(f"{len(ev.blocks)} donor pages hold no whole page of ours")
        except (MappingError, ValueError) as exc:  # expected: give the pages back, stream on
            logger.warning("SwiftCache: cannot use the lease from %s for the layer store (%s); "
                           "releasing it", donor, exc)
            self.agent.release(ev.key)
            self.on_failed(donor, "unusable grant")
            return
        self._failures = 0
        self._layouts[donor] = mapped.layout
        lease = self.store.add_lease(ev.key, packing, mapped.region,
                                     self._readable(donor, lease_id, mapped))
        lease.mapping = ev.memory.owner_uuid  # unmapped only once no lease of it is in the store
        self.leases[(donor, ev.key.lease_id)] = lease
        self.stats["leases"] += 1
        logger.info("SwiftCache layer streaming: borrowing %d pages of %s's pool as %d store "
                    "pages (lease %d, epoch %d, %d bytes unused)", len(ev.blocks), donor,
                    packing.num_blocks, ev.key.lease_id, ev.key.epoch, packing.unused_bytes)
        self.maybe_request(False)  # place its pages now

    def _readable(self, donor: str, lease_id: int, mapped: Any):
        """Whether a lease may be read now: inside its read deadline (every call) and the donor
        process there (a syscall, so at most every LIVENESS_CHECK_S: the deadline already ends
        reads of a silent donor within a heartbeat timeout)."""
        checked = [0.0]  # when the donor process was last seen alive

        def readable() -> bool:
            now = time.monotonic()
            if now >= self.agent.read_deadline(donor, lease_id):
                return False
            if now - checked[0] >= LIVENESS_CHECK_S:
                if not mapped.alive():
                    return False
                checked[0] = now
            return True

        return readable

    def fence(self, ev: ReclaimRequested) -> bool:
        """Any thread (the agent's, as the reclaim arrives): flip the store pages on the
        reclaimed blocks to host; returns once no copy reads them, so the caller may
        acknowledge. False when the lease is not known here yet (nothing reads it then)."""
        lease = self.leases.get((ev.key.donor, ev.key.lease_id))
        if lease is None:
            return False
        flipped = self.store.fence(lease, ev.blocks)
        if flipped:
            logger.info("SwiftCache layer streaming: %s reclaimed %d pages of lease %d; %d %s "
                        "now %s", ev.key.donor, len(ev.blocks), ev.key.lease_id, flipped,
                        self.UNITS, self.FALLBACK)
        return True

    def on_reclaim(self, ev: ReclaimRequested, tree: Any) -> None:
        """Scheduler thread: fence (a no-op when the agent's thread did already); the caller
        acknowledges after this returns. Nothing is lost, so there is no tree revoke."""
        self.fence(ev)
        return None

    def on_lost(self, ev: LeaseLost, tree: Any) -> None:
        lease = self.leases.pop((ev.key.donor, ev.key.lease_id), None)
        if lease is None:
            return None
        flipped = self.store.drop(lease)
        self.stats["lost_leases"] += 1
        logger.warning("SwiftCache layer streaming: lease %s lost (%s); its %d %s now %s, "
                       "nothing lost", ev.key, ev.reason, flipped, self.UNITS, self.FALLBACK)
        self._drop_dead_mappings()
        return None

    def _drop_dead_mappings(self) -> None:
        """A dead donor's other leases leave the store (their pages flip to host, no copy reads
        them) before its pool is unmapped and unlinked."""
        for key, lease in list(self.leases.items()):
            mapped = self._mapped.get(lease.mapping)
            if mapped is not None and not owner_alive(mapped.descriptor["owner_pid"]):
                flipped = self.store.drop(self.leases.pop(key))
                self.stats["lost_leases"] += 1
                logger.warning("SwiftCache layer streaming: lease %s of a dead donor dropped; its "
                               "%d %s now %s", lease.key, flipped, self.UNITS, self.FALLBACK)
        super()._drop_dead_mappings()

    def attach_tree(self, tree: Any) -> None:
        """The tree holds nothing of these leases."""

    def lease_engine(self, donor: str, lease_id: int) -> None:
        """No tree copies in this mode: any that asked would be refused (and recomputed)."""
        return None

    def close(self) -> None:
        for lease in list(self.leases.values()):
            self.store.drop(lease)
        self.leases.clear()
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
        if self._lane is not None:
            self._lane.close()
