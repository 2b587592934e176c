"""The borrower side: leases of pages of other servers' KV pools, and the copies the tree asks for.

A lease grant names donor pool pages and carries the donor pool's descriptor and `PoolLayout`.
The borrower maps that pool once per donor incarnation (`map_pool`), lays its own pages out over
the granted donor pages as one byte stream (`LeasePacking`: any two model shapes), and hands the
tree a lease of `packing.num_blocks` blocks: the tree's lease-local block i IS packing block i.
Copies go through one `PoolTransferEngine` per lease.

Block numbers (docs/dataplane.md "Block numbers"): the tree and `DonorResidency.blocks` hold
lease-local borrower blocks; the control channel (grants, reclaims) holds donor page ids;
`packing.blocks_touching(pages)` converts the latter into the former.

Faults are expected events. A reclaim is acknowledged from the control agent's thread as soon as
no copy touches the reclaimed pages (`fence`: later copies touching them are refused, those in
flight aborted and waited out), without waiting for the scheduler loop; the tree, which only the
scheduler thread may touch, revokes those blocks at its next pump (`on_reclaim`), and until then
every copy touching them is refused (the ticket aborts; the request recomputes). A lost lease is
revoked whole on the scheduler thread. A copy whose donor is not readable now (read deadline
passed, process gone) is refused too.

Threads: everything runs on the scheduler thread except `fence`, which the runtime calls on the
agent's thread; it reads `leases` (one dict lookup) and the lease's immutable packing, and
touches only the engine's thread-safe fence.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..control import LeaseGranted, LeaseKey, LeaseLost, ReclaimRequested
from . import (
    LeasePacking,
    MappingError,
    PoolTransferEngine,
    map_pool,
    owner_alive,
    unlink_descriptor,
)
from .pool_layout import PoolLayout
from .streams import make_lane

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


@dataclass
class Staged:
    """Lease blocks read before a reclaim let them go: block `blocks[i]` is rows
    `i * page_size ...` of the per-layer `k` / `v` tensors."""

    blocks: list
    k: list
    v: list


@dataclass(frozen=True)
class FenceSteps:
    """What one `Borrowing.fence` did: the lease blocks it fenced, the ms it took to find them
    (`LeasePacking.blocks_touching`) and to fence and stop the copies on them
    (`PoolTransferEngine.fence`), and how many copies in flight it aborted; `staged_ms`: the
    read of the blocks for the host tier before the fence (0 without one)."""

    blocks: int
    blocks_ms: float
    copies_ms: float
    aborted: int
    staged_ms: float = 0.0


class Borrowing:
    """All leases this server holds; runs on the scheduler thread (`fence`: any thread)."""

    last_fence: FenceSteps | None = None  # the latest fence's steps (runtime's log line)
    # With a host tier below (set by the cache): `fence` first reads the reclaimed blocks
    # into memory of this server's own (`_stage`), and `on_reclaim` moves what the tree
    # rescues into host slots through `write_host(host_slots, k_rows, v_rows)`.
    write_host: Any = None

    def __init__(self, *, max_blocks: int, geometry: Any, kv_pool: Any, agent: Any,
                 stats: dict) -> None:
        self.max_blocks = max_blocks
        self.geometry = geometry
        self.kv_pool = kv_pool
        self.agent = agent
        self.stats = stats
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
        self._staged: dict[tuple[str, int], list[Staged]] = {}
        self._fenced: set = set()  # (lease key, reclaim id) of reclaims fenced once already
        self._staged_lock = threading.Lock()

    # ---- asking for leases --------------------------------------------------------------
    @property
    def held_blocks(self) -> int:
        return sum(h.held for h in self.leases.values())

    def held_tokens(self) -> int:
        return self.held_blocks * self.geometry.page_size

    def maybe_request(self, peers_present: bool) -> None:
        """Ask for what is missing up to `max_blocks`, once at a time, backing off after a
        refusal. The request counts donor pages: sized from the donor's pool layout (a grant's,
        else the one the donor advertises in its Hello), else one page per wanted block."""
        if self._pending or not peers_present or time.monotonic() < self._retry_at:
            return
        want = self.max_blocks - self.held_blocks
        if want <= 0:
            return
        layout = next(iter(self._layouts.values()), None) or self._advertised_layout()
        pages = LeasePacking.pages_for(self.geometry, layout, want) if layout else want
        self.agent.request(max(1, min(pages, 65536)))
        self._pending = True

    def _advertised_layout(self) -> Any:
        """The layout the donor a request would go to advertises, as a PoolLayout, or None."""
        advertised = self.agent.donor_layout()
        if advertised is None:
            return None
        try:
            return PoolLayout.from_dict(advertised)  # the wire struct's fields
        except ValueError:
            return None

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
            if ev.memory.kind == "cuda_ipc":  # the same GPU numbering, and peer access
                from .cuda_ipc import check_reachable

                check_reachable(ev.memory.device, self.kv_pool.k_buffer[0].device)
            mapped = self._map(ev.memory)
            packing = LeasePacking(self.geometry, mapped.layout, list(ev.blocks))
            donor = ev.key.donor
            engine = PoolTransferEngine(packing, mapped.region, self.kv_pool.k_buffer,
                                        self.kv_pool.v_buffer, liveness=mapped.alive,
                                        read_deadline=lambda: self.agent.read_deadline(donor),
                                        lane=self._lane,
                                        lease_epoch=self._epoch_reader(ev.key))
        except (MappingError, ValueError) as exc:  # expected: give the pages back, run without
            self.agent.release(ev.key)
            if getattr(exc, "reason", None) == "unreachable":  # a deployment fault: never again
                self.agent.avoid_donor(ev.key.donor)
                logger.warning("SwiftCache: cannot read donor %s's memory (%s); this server "
                               "will not borrow from it, and both keep serving", ev.key.donor,
                               exc)
            else:
                logger.warning("SwiftCache: cannot use the lease from %s (%s); releasing it",
                               ev.key.donor, exc)
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

    def _epoch_reader(self, key: LeaseKey):
        """The epoch the borrower holds lease `key` under now (None once it is lost); read on
        the copy thread after each layer (one dict lookup), so bytes copied under a lease that
        was lost or granted again meanwhile are never used."""
        where = (key.donor, key.lease_id)

        def epoch():
            held = self.leases.get(where)
            return None if held is None else held.key.epoch
        return epoch

    def fence(self, ev: ReclaimRequested) -> bool:
        """Any thread (the agent's, on a reclaim): refuse every later copy touching the
        reclaimed pages and stop those in flight; returns once none touches them (CPU: at most
        one layer of each copy; GPU: this lease's enqueued copies). False when the lease is not
        known here yet (its grant still queued for the scheduler): nothing can copy on it, and
        the scheduler fences and acknowledges at its pump (`on_reclaim`)."""
        held = self.leases.get((ev.key.donor, ev.key.lease_id))
        if held is None:
            return False
        start = time.perf_counter()
        blocks = held.packing.blocks_touching(ev.blocks, strict=False)
        found = time.perf_counter()
        if self.write_host is not None and self._first_fence(ev):
            # only before the ack, which follows the first fence of a reclaim: a later fence
            # (the scheduler's, at its pump) may run after the donor took the pages back
            self._stage(held, [b for b in blocks if b not in held.gone], ev.deadline)
        mid = time.perf_counter()
        aborted = held.engine.fence(blocks)
        # the steps of this fence, for the runtime's log line (read on the thread that fenced)
        self.last_fence = FenceSteps(len(blocks), (found - start) * 1e3,
                                     (time.perf_counter() - mid) * 1e3, aborted,
                                     (mid - found) * 1e3)
        return True

    def _map(self, memory: Any) -> Any:
        """The donor pool of a grant's descriptor, mapped once per donor incarnation."""
        mapped = self._mapped.get(memory.owner_uuid)
        if mapped is None:
            mapped = map_pool(memory)
            self._mapped[memory.owner_uuid] = mapped
        return mapped

    def on_reclaim(self, ev: ReclaimRequested, tree: Any) -> Any:
        """Scheduler thread, at the pump after the reclaim arrived: fence the reclaimed pages
        (a no-op when the agent's thread did already) and revoke their blocks from the tree;
        the caller acknowledges after this returns (again, if the fence acknowledged: the agent
        ignores a second ack). Returns the tree's RevokeResult or None."""
        held = self.leases.get((ev.key.donor, ev.key.lease_id))
        if held is None:
            return None
        self.fence(ev)
        local = [b for b in held.packing.blocks_touching(ev.blocks, strict=False)
                 if b not in held.gone]
        staged = []
        if self.write_host is not None:
            with self._staged_lock:
                staged = self._staged.pop((ev.key.donor, ev.key.lease_id), [])
                self._fenced.discard((ev.key, ev.reclaim_id))
        rows = {b: (part, i) for part in staged for i, b in enumerate(part.blocks)}
        rescue = bool(local) and all(b in rows for b in local)
        result = tree.revoke(ev.key.donor, lease_id=ev.key.lease_id, blocks=local,
                             rescue=rescue)
        held.gone.update(local)
        if result.moved:
            self._write_rescued(result.moved, rows, held.packing.borrower.page_size)
        return result

    def _first_fence(self, ev: ReclaimRequested) -> bool:
        """Whether this is the first fence of reclaim `ev` (any thread)."""
        tag = (ev.key, ev.reclaim_id)
        with self._staged_lock:
            if tag in self._fenced:
                return False
            self._fenced.add(tag)
            return True

    def _stage(self, held: BorrowedLease, blocks: list[int], deadline: float) -> None:
        """Read lease blocks `blocks` into fresh local memory before the fence lets them go
        (CPU engines: on the calling thread, the agent's; a GPU lease is not staged yet, so its
        reclaimed prefixes are recomputed as without a host tier). What could not be read is
        not staged: the tree then drops those copies."""
        if not blocks or held.engine.lane.stream is not None:
            return
        g = held.packing.borrower
        rows = len(blocks) * g.page_size
        dev = held.engine.local_device
        ks = [torch.empty(rows, g.num_kv_heads, g.head_dim, dtype=g.dtype, device=dev)
              for _ in range(g.num_layers)]
        vs = [torch.empty(rows, g.num_kv_heads, g.v_head_dim, dtype=g.dtype, device=dev)
              for _ in range(g.num_layers)]
        e = held.engine
        # the lease's own read deadline (its donor vouched for it recently) and the reclaim's
        # (the donor may take the pages back without an ack after it): bytes read past either
        # could be the donor's own again, so the read fails and the prefixes are recomputed
        reader = PoolTransferEngine(held.packing, e.region, ks, vs, lane=e.lane,
                                    liveness=e.liveness, lease_epoch=e.lease_epoch,
                                    read_deadline=lambda: min(e.read_deadline(), deadline))
        result = reader.load_here(torch.arange(rows), blocks)
        if not result.ok:
            logger.warning("SwiftCache: could not read the reclaimed blocks of lease %s before "
                           "letting them go (%s); their prefixes will be recomputed",
                           held.key, result.reason)
            return
        with self._staged_lock:
            self._staged.setdefault((held.key.donor, held.key.lease_id), []).append(
                Staged(list(blocks), ks, vs))

    def _write_rescued(self, moved: tuple, rows: dict, page: int) -> None:
        """Write the staged rows of each rescued copy into the host slots the tree gave it."""
        host = []
        picks: dict[int, list] = {}  # id(part) -> (position in the write, row in the part)
        parts = {}
        order = []
        for t in moved:
            for i, slot in enumerate(t.dst.indices):
                part, pos = rows[t.src.blocks[i // page]]
                parts[id(part)] = part
                picks.setdefault(id(part), []).append((len(host), pos * page + i % page))
                host.append(slot)
                order.append(id(part))
        n = len(host)
        first = next(iter(parts.values()))
        ks = [torch.empty((n, *k.shape[1:]), dtype=k.dtype, device=k.device) for k in first.k]
        vs = [torch.empty((n, *v.shape[1:]), dtype=v.dtype, device=v.device) for v in first.v]
        for pid, pairs in picks.items():
            part = parts[pid]
            at = torch.tensor([a for a, _ in pairs])
            src = torch.tensor([b for _, b in pairs])
            for layer in range(len(ks)):
                ks[layer][at] = part.k[layer][src]
                vs[layer][at] = part.v[layer][src]
        self.write_host(torch.tensor(host, dtype=torch.int64), ks, vs)
        self.stats["rescued_tokens"] = self.stats.get("rescued_tokens", 0) + n

    def on_lost(self, ev: LeaseLost, tree: Any) -> Any:
        held = self.leases.pop((ev.key.donor, ev.key.lease_id), None)
        if held is None:
            return None
        self._abort_inflight((ev.key.donor, ev.key.lease_id), "lease lost")
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
        """Register an in-flight copy so a lost lease aborts it. (A reclaim finds the copies
        touching its pages through the engine's fence, on any thread.)"""
        self._inflight.setdefault(key, []).append((handle, blocks))

    def untrack(self, key: tuple[str, int], handle: Any) -> None:
        runs = self._inflight.get(key, [])
        runs[:] = [(h, b) for h, b in runs if h is not handle]
        if not runs:
            self._inflight.pop(key, None)

    def _abort_inflight(self, key: tuple[str, int], why: str) -> None:
        for handle, _ in list(self._inflight.get(key, [])):
            handle.abort(why)
