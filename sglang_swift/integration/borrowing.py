"""The borrower side: leases of pages of other servers' KV pools, and the copies the tree asks for.

A lease grant names donor pool pages and carries the donor pool's descriptor and `PoolLayout`.
The borrower maps that pool once per donor incarnation (`map_pool`), lays its own pages out over
the granted donor pages as one byte stream (`LeasePacking`: any two model shapes), and hands the
tree a lease of `packing.num_blocks` blocks: the tree's lease-local block i IS packing block i.
Copies go through one `PoolTransferEngine` per lease.

Block numbers (docs/dataplane.md "Block numbers"): the tree and `DonorResidency.blocks` hold
lease-local borrower blocks; the control channel (grants, reclaims) holds donor page ids;
`packing.blocks_touching(pages)` converts the latter into the former.

Faults are expected events: a reclaim is revoked from the tree, and in-flight copies touching
the reclaimed pages are aborted, before it is acknowledged; a lost lease is revoked whole; a copy
whose donor is not readable now (read deadline passed, process gone) is refused, so the caller
aborts its ticket and the request recomputes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..control import LeaseGranted, LeaseKey, LeaseLost, ReclaimRequested
from ..dataplane import (LeasePacking, MappingError, PoolTransferEngine, map_pool, owner_alive,
                         unlink_descriptor)
from ..dataplane.streams import make_lane

logger = logging.getLogger(__name__)
RETRY_MIN_S, RETRY_MAX_S = 0.5, 10.0  # back-off between failed lease requests


@dataclass
class BorrowedLease:
    """A lease this server borrows: donor pages `pages` (grant order) packed into
    `packing.num_blocks` borrower blocks; `gone` holds the blocks the donor took back."""

    key: LeaseKey
    pages: list[int]
    packing: LeasePacking
    engine: PoolTransferEngine
    gone: set[int] = field(default_factory=set)

    @property
    def held(self) -> int:
        return self.packing.num_blocks - len(self.gone)


class Borrowing:
    """All leases this server holds; runs on the scheduler thread."""

    def __init__(self, *, max_blocks: int, geometry: Any, kv_pool: Any, agent: Any,
                 stats: dict, copy_timeout_s: float) -> None:
        self.max_blocks = max_blocks
        self.geometry = geometry
        self.kv_pool = kv_pool
        self.agent = agent
        self.stats = stats
        self.copy_timeout_s = copy_timeout_s
        self.leases: dict[tuple[str, int], BorrowedLease] = {}
        self._mapped: dict[str, Any] = {}  # donor pool owner_uuid -> MappedPool
        self._layouts: dict[str, Any] = {}  # donor agent id -> its pool layout (from a grant)
        device = kv_pool.k_buffer[0].device
        # CPU: one copy thread for every lease; GPU: each engine makes a lane for its peer device
        self._lane = make_lane(device) if device.type == "cpu" else None
        self._pending = False
        self._retry_at = 0.0
        self._failures = 0
        self._inflight: dict[tuple[str, int], list[tuple[Any, set[int]]]] = {}

    # ---- asking for leases --------------------------------------------------------------
    @property
    def held_blocks(self) -> int:
        return sum(h.held for h in self.leases.values())

    def held_tokens(self) -> int:
        return self.held_blocks * self.geometry.page_size

    def maybe_request(self, peers_present: bool) -> None:
        """Ask for what is missing up to `max_blocks`, once at a time, backing off after a
        refusal. The request counts donor pages: sized from the donor's layout once a grant
        told it, else one page per wanted block."""
        if self._pending or not peers_present or time.monotonic() < self._retry_at:
            return
        want = self.max_blocks - self.held_blocks
        if want <= 0:
            return
        layout = next(iter(self._layouts.values()), None)
        pages = LeasePacking.pages_for(self.geometry, layout, want) if layout else want
        self.agent.request(max(1, min(pages, 65536)))
        self._pending = True

    def on_failed(self, donor: str, reason: str) -> None:
        self._pending = False
        self._failures += 1
        delay = min(RETRY_MAX_S, RETRY_MIN_S * 2 ** (self._failures - 1))
        self._retry_at = time.monotonic() + delay
        logger.info("SwiftCache: lease request to %s failed (%s); next try in %.1f s",
                    donor or "any donor", reason, delay)

    # ---- lease events -------------------------------------------------------------------
    def on_granted(self, ev: LeaseGranted, tree: Any) -> None:
        self._pending = False
        try:
            mapped = self._mapped.get(ev.memory.owner_uuid)
            if mapped is None:
                mapped = map_pool(ev.memory)
                self._mapped[ev.memory.owner_uuid] = mapped
            packing = LeasePacking(self.geometry, mapped.layout, list(ev.blocks))
            donor = ev.key.donor
            engine = PoolTransferEngine(packing, mapped.region, self.kv_pool.k_buffer,
                                        self.kv_pool.v_buffer, liveness=mapped.alive,
                                        read_deadline=lambda: self.agent.read_deadline(donor),
                                        lane=self._lane)
        except (MappingError, ValueError) as exc:  # expected: give the pages back, run without
            logger.warning("SwiftCache: cannot use the lease from %s (%s); releasing it",
                           ev.key.donor, exc)
            self.agent.release(ev.key)
            self.on_failed(ev.key.donor, "unusable grant")
            return
        self._failures = 0
        self._layouts[ev.key.donor] = mapped.layout
        held = BorrowedLease(ev.key, list(ev.blocks), packing, engine)
        self.leases[(ev.key.donor, ev.key.lease_id)] = held
        tree.donor.add_lease(ev.key.donor, ev.key.lease_id, ev.key.epoch, packing.num_blocks)
        self.stats["leases"] += 1
        logger.info("SwiftCache: borrowing %d pages of %s's pool as %d blocks of ours "
                    "(lease %d, epoch %d, %d bytes unused)", len(ev.blocks), ev.key.donor,
                    packing.num_blocks, ev.key.lease_id, ev.key.epoch, packing.unused_bytes)

    def on_reclaim(self, ev: ReclaimRequested, tree: Any) -> Any:
        """Revoke the blocks on the reclaimed pages from the tree and stop copies touching them;
        the caller acknowledges after this returns. Returns the tree's RevokeResult or None."""
        held = self.leases.get((ev.key.donor, ev.key.lease_id))
        if held is None:
            return None
        local = [b for b in held.packing.blocks_touching(ev.blocks, strict=False)
                 if b not in held.gone]
        self._abort_inflight((ev.key.donor, ev.key.lease_id), set(local), "reclaimed")
        result = tree.revoke(ev.key.donor, lease_id=ev.key.lease_id, blocks=local)
        held.gone.update(local)
        return result

    def on_lost(self, ev: LeaseLost, tree: Any) -> Any:
        held = self.leases.pop((ev.key.donor, ev.key.lease_id), None)
        if held is None:
            return None
        self._abort_inflight((ev.key.donor, ev.key.lease_id), None, "lease lost")
        result = tree.revoke(ev.key.donor, lease_id=ev.key.lease_id)
        held.engine.close()
        self._drop_dead_mappings()
        return result

    def attach_tree(self, tree: Any) -> None:
        """The cache was reset (a new, empty tree): register the leases still held in it."""
        for held in self.leases.values():
            k = held.key
            tree.donor.add_lease(k.donor, k.lease_id, k.epoch, held.packing.num_blocks)
            if held.gone:
                tree.donor.remove_blocks(k.donor, k.lease_id, held.gone)

    def _drop_dead_mappings(self) -> None:
        """Unmap pools whose donor process is gone; a donor killed with SIGKILL could not unlink
        its shared memory, so the borrower that notices does."""
        for uuid, mapped in list(self._mapped.items()):
            if not owner_alive(mapped.descriptor["owner_pid"]):
                desc = mapped.descriptor
                mapped.close()
                del self._mapped[uuid]
                unlink_descriptor(desc)

    def close(self) -> None:
        for held in self.leases.values():
            held.engine.close()
        for mapped in self._mapped.values():
            mapped.close()
        self.leases.clear()
        self._mapped.clear()
        if self._lane is not None:
            self._lane.close()

    # ---- copies -------------------------------------------------------------------------
    def lease_engine(self, donor: str, lease_id: int) -> PoolTransferEngine | None:
        """The engine of a lease that may be read now, else None."""
        held = self.leases.get((donor, lease_id))
        if held is None or time.monotonic() >= self.agent.read_deadline(donor):
            return None
        return held.engine

    def track(self, key: tuple[str, int], handle: Any, blocks: set[int]) -> None:
        """Register an in-flight copy so a reclaim of its blocks aborts it before the ack."""
        self._inflight.setdefault(key, []).append((handle, blocks))

    def untrack(self, key: tuple[str, int], handle: Any) -> None:
        runs = self._inflight.get(key, [])
        runs[:] = [(h, b) for h, b in runs if h is not handle]

    def _abort_inflight(self, key: tuple[str, int], blocks: set[int] | None, why: str) -> None:
        for handle, used in list(self._inflight.get(key, [])):
            if blocks is None or used & blocks:
                handle.abort(why)

    def store(self, items: Sequence[tuple[Sequence[int], Any]]) -> list[bool]:
        """Copy each (device slots, donor residency) pair into its donor blocks, in order; per
        pair, whether its copy happened (False: the caller aborts that store)."""
        done = [False] * len(items)
        for key, idxs in _batches(items, lambda item: item[1]):
            ok = self._copy(key, [items[i][0] for i in idxs], [items[i][1] for i in idxs], None)
            self.stats["refused_stores"] += 0 if ok else 1
            for i in idxs:
                done[i] = ok
        return done

    def load(self, items: Sequence[tuple[Any, Sequence[int]]], counter: Any) -> bool:
        """Copy each (donor residency, device slots) pair back, layer by layer, signalling
        `counter`; False (treat every slot as garbage) if any copy could not run."""
        for key, idxs in _batches(items, lambda item: item[0]):
            if not self._copy(key, [items[i][1] for i in idxs], [items[i][0] for i in idxs],
                              counter):
                self.stats["refused_loads"] += 1
                return False
        return True

    def _copy(self, key: tuple[str, int], slot_lists: list, residencies: list, counter) -> bool:
        engine = self.lease_engine(*key)
        if engine is None:
            return False
        slots = torch.as_tensor([s for lst in slot_lists for s in lst], dtype=torch.int64)
        blocks = [b for r in residencies for b in r.blocks]
        if counter is None:
            handle = engine.begin_store(slots, blocks)
        else:
            handle = engine.begin_load(slots, blocks, counter)
        self.track(key, handle, set(blocks))
        try:
            ok = handle.wait(self.copy_timeout_s).ok
        finally:
            self.untrack(key, handle)
        if ok:
            self.stats["stored_tokens" if counter is None else "loaded_tokens"] += len(slots)
        return ok


def _batches(items: Sequence, residency_of) -> list[tuple[tuple[str, int], list[int]]]:
    """Split `items` (in order) into runs on one lease with no block repeated within a run."""
    runs: list[tuple[tuple[str, int], list[int]]] = []
    seen: set[int] = set()
    for i, item in enumerate(items):
        res = residency_of(item)
        key = (res.donor, res.lease)
        if not runs or runs[-1][0] != key or seen.intersection(res.blocks):
            runs.append((key, []))
            seen = set()
        runs[-1][1].append(i)
        seen.update(res.blocks)
    return runs
