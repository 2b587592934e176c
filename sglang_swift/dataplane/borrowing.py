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

Tensor parallelism (`tp`, `integration/tp_sync.py`): every rank holds the same leases (rank 0's
grants, applied by every rank at the same pump) and packs its own shard of each block
(`LeasePacking(shard=(rank, ranks))`); a grant is used only when every rank could map it.
A TP donor's grant names every donor rank's pool (`MemoryDescriptor.ranks`, the same page ids
in each); borrower rank r maps the donor ranks `donor_ranks_of` names (docs/integration.md
"Tensor parallelism"). When it maps several, each is a sub-lease of the grant: its own packing,
engine and tree lease (id `sub_lease_id`), all fenced, revoked and lost with the grant.

Threads: everything runs on the scheduler thread except `fence`, which the runtime calls on the
agent's thread; it reads `leases` (a dict lookup per sub-lease) and the immutable packings, and
touches only the engine's thread-safe fence.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

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
from .pool_lease import pool_buffers, pool_device
from .rank_map import donor_ranks_of, merged_revokes, shape_of, sub_lease_id
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
    # `staging` (with a host tier below): `fence` first reads the reclaimed blocks into memory
    # of this server's own, and `on_reclaim` moves what the tree rescues into host slots
    # (`reclaim_staging.ReclaimStaging`). `spill` (with L3 below the host tier):
    # `spill(unrescued, rows, page) -> tokens` writes the staged rows of the copies the rescue
    # found no host room for into storage (`StorageHits.spill`). Both None: neither tier.
    staging: Any = None
    spill: Any = None
    shard: tuple[int, int] = (0, 1)  # (this rank, the server's TP ranks)
    geometry: Any = None  # this rank's KV page (KVGeometry)

    def __init__(self, *, max_blocks: int, geometry: Any, kv_pool: Any, agent: Any,
                 stats: dict, tp: Any = None, staging: Any = None, spill: Any = None) -> None:
        self.tp = tp  # tp_sync.TpGroup with --tp > 1, else None
        self.staging, self.spill = staging, spill
        self.shard = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.max_blocks = max_blocks
        self.geometry = geometry
        self.kv_pool = kv_pool
        self.agent = agent
        self.stats = stats
        self.leases: dict[tuple[str, int], BorrowedLease] = {}
        self._mapped: dict[str, Any] = {}  # donor pool owner_uuid -> MappedPool
        self._layouts: dict[str, Any] = {}  # donor agent id -> its pool layout (from a grant)
        self._donor_ranks_n: dict[str, int] = {}  # donor agent id -> its TP ranks (a grant's)
        self._buffers = pool_buffers(kv_pool)  # (K, V) per layer; an MLA pool: latent, none
        self._device = device = pool_device(kv_pool)
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
        refusal. The request counts donor pages: sized from the donor's pool layout (a grant's,
        else the one the donor advertises in its Hello), else one page per wanted block."""
        if self._pending or not peers_present or time.monotonic() < self._retry_at:
            return
        want = self.max_blocks - self.held_blocks
        if want <= 0:
            return
        donor, layout = next(iter(self._layouts.items()), (None, None))
        layout = layout or self._advertised_layout()
        pages = (self._pages_for(layout, self._donor_ranks_n.get(donor, 1), want) if layout
                 else want)
        self.agent.request(max(1, min(pages, 65536)))
        self._pending = True

    def _pages_for(self, layout: Any, donor_ranks: int, want: int) -> int:
        """Donor page ids for `want` blocks on each rank, by `donor_ranks_of`'s mapping (a
        donor whose rank count is not known yet counts as one rank)."""
        ranks = self.shard[1]
        if donor_ranks % ranks == 0:
            k = donor_ranks // ranks
            return -(-LeasePacking.pages_for(self.geometry, layout, want) // k)
        if ranks % donor_ranks == 0:
            return LeasePacking.pages_for(self.geometry, layout, want,
                                          ranks=ranks // donor_ranks)
        return LeasePacking.pages_for(self.geometry, layout, want, ranks=ranks)

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
            subs = self._build(ev)
        except (MappingError, ValueError) as exc:  # expected: give the pages back, run without
            if self.tp is not None:
                self.tp.all_ok(False)  # the other ranks wait for this rank's word
            self.agent.release(ev.key)
            if getattr(exc, "reason", None) in ("unreachable", "geometry"):  # never again
                self.agent.avoid_donor(ev.key.donor)
                logger.warning("SwiftCache: cannot read donor %s's memory (%s); this server "
                               "will not borrow from it, and both keep serving", ev.key.donor,
                               exc)
            else:
                logger.warning("SwiftCache: cannot use the lease from %s (%s); releasing it",
                               ev.key.donor, exc)
            self.on_failed(ev.key.donor, "unusable grant")
            return
        if self.tp is not None and not self.tp.all_ok(True):  # another rank could not map it
            for held in subs:
                held.engine.close()
            self.agent.release(ev.key)
            logger.warning("SwiftCache: another TP rank cannot use the lease from %s; "
                           "releasing it", ev.key.donor)
            self.on_failed(ev.key.donor, "unusable grant on another TP rank")
            return
        self._failures = 0
        donor_ranks = len(getattr(ev.memory, "ranks", None) or ()) or 1
        self._layouts[ev.key.donor] = subs[0].packing.donor
        self._donor_ranks_n[ev.key.donor] = donor_ranks
        for held in subs:
            self.leases[(held.key.donor, held.key.lease_id)] = held
            tree.donor.add_lease(held.key.donor, held.key.lease_id, held.key.epoch,
                                 held.packing.num_blocks)
        self.stats["leases"] += 1
        blocks = sum(h.packing.num_blocks for h in subs)
        ranks = "" if donor_ranks == 1 else (
            f" (donor ranks {', '.join(str(d) for d, _ in self._donor_ranks(donor_ranks))} of "
            f"{donor_ranks})")
        logger.info("SwiftCache: borrowing %d pages of %s's pool%s as %d blocks of ours "
                    "(lease %d, epoch %d, %d bytes unused)", len(ev.blocks), ev.key.donor,
                    ranks, blocks, ev.key.lease_id, ev.key.epoch,
                    sum(h.packing.unused_bytes for h in subs))

    def _donor_ranks(self, donor_ranks: int, layout: Any = None) -> list:
        return donor_ranks_of(self.shard[0], self.shard[1], donor_ranks, self.geometry, layout)

    def _build(self, ev: LeaseGranted) -> list[BorrowedLease]:
        """This rank's sub-leases of a grant: each donor rank pool it maps (`donor_ranks_of`),
        mapped, packed and given an engine. Raises MappingError or ValueError (nothing left
        open) when a pool cannot be used; "geometry" when the shapes cannot be mapped."""
        memories = list(getattr(ev.memory, "ranks", None) or ()) or [ev.memory]
        layouts = [None] if len(memories) == 1 else [
            PoolLayout.from_dict(m.layout) if m.layout is not None else None for m in memories]
        if len({repr(x) for x in layouts}) > 1:
            raise MappingError("geometry", "the donor's rank pools differ in shape (" + "; ".join(
                f"rank {d}: {shape_of(getattr(x, 'geometry', None))}"
                for d, x in enumerate(layouts)) + ")")
        built: list[BorrowedLease] = []
        donor = ev.key.donor

        def deadline() -> float:
            return self.agent.read_deadline(donor)
        try:
            for j, (d, shard) in enumerate(self._donor_ranks(len(memories), layouts[0])):
                memory = memories[d]
                index = None
                if memory.kind == "cuda_ipc":  # the donor's GPU by UUID, and peer access
                    from .cuda_ipc import check_reachable

                    index = check_reachable(memory.device, self._device)
                mapped = self._map(memory, index)
                packing = LeasePacking(self.geometry, mapped.layout, list(ev.blocks),
                                       shard=shard)
                key = LeaseKey(ev.key.donor, ev.key.epoch, sub_lease_id(ev.key.lease_id, j))
                engine = PoolTransferEngine(packing, mapped.region, *self._buffers,
                                            liveness=mapped.alive,
                                            read_deadline=deadline, lane=self._lane,
                                            lease_epoch=self._epoch_reader(key))
                built.append(BorrowedLease(key, list(ev.blocks), packing, engine))
        except BaseException:
            for held in built:
                held.engine.close()
            raise
        return built

    def _subs(self, key: LeaseKey) -> list[BorrowedLease]:
        """The sub-leases this rank holds of grant `key` (one unless a TP donor's)."""
        out = []
        while (held := self.leases.get((key.donor, sub_lease_id(key.lease_id, len(out))))):
            out.append(held)
        return out

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
        the scheduler fences and acknowledges at its pump (`on_reclaim`). A TP donor's grant:
        the same pages of every sub-lease."""
        subs = self._subs(ev.key)
        if not subs:
            return False
        found_ms = copies_ms = staged_ms = 0.0
        n_blocks = aborted = 0
        for held in subs:
            t0 = time.perf_counter()
            blocks = held.packing.blocks_touching(ev.blocks, strict=False)
            found = time.perf_counter()
            if self.staging is not None and len(subs) == 1 and self.staging.first_fence(ev):
                # only before the ack, which follows the first fence of a reclaim: a later
                # fence (the scheduler's, at its pump) may run after the donor took the pages
                # back. (A grant of several sub-leases is not staged: it is recomputed.)
                self.staging.stage(held, [b for b in blocks if b not in held.gone],
                                   ev.deadline)
            mid = time.perf_counter()
            aborted += held.engine.fence(blocks)
            n_blocks += len(blocks)
            found_ms += (found - t0) * 1e3
            staged_ms += (mid - found) * 1e3
            copies_ms += (time.perf_counter() - mid) * 1e3
        # the steps of this fence, for the runtime's log line (read on the thread that fenced)
        self.last_fence = FenceSteps(n_blocks, found_ms, copies_ms, aborted, staged_ms)
        return True

    def _map(self, memory: Any, cuda_index: int | None = None) -> Any:
        """The donor pool of a grant's descriptor, mapped once per donor incarnation (on this
        process's GPU `cuda_index` for a CUDA region)."""
        mapped = self._mapped.get(memory.owner_uuid)
        if mapped is None:
            mapped = map_pool(memory, cuda_index)
            self._mapped[memory.owner_uuid] = mapped
        return mapped

    def on_reclaim(self, ev: ReclaimRequested, tree: Any) -> Any:
        """Scheduler thread, at the pump after the reclaim arrived: fence the reclaimed pages
        (a no-op when the agent's thread did already) and revoke their blocks from the tree;
        the caller acknowledges after this returns (again, if the fence acknowledged: the agent
        ignores a second ack). Returns the tree's RevokeResult (of every sub-lease) or None."""
        subs = self._subs(ev.key)
        if not subs:
            return None
        self.fence(ev)
        results = []
        for held in subs:
            local = [b for b in held.packing.blocks_touching(ev.blocks, strict=False)
                     if b not in held.gone]
            rows = (self.staging.take(ev, self.tp) if self.staging is not None
                    and len(subs) == 1 else {})  # with TP: rows only if every rank staged
            rescue = bool(local) and all(b in rows for b in local)
            result = tree.revoke(ev.key.donor, lease_id=held.key.lease_id, blocks=local,
                                 rescue=rescue)
            held.gone.update(local)
            if result.moved:
                n = self.staging.write(result.moved, rows, held.packing.borrower.page_size,
                                       tree, self.tp)
                self.stats["rescued_tokens"] = self.stats.get("rescued_tokens", 0) + n
            if result.unrescued and self.spill is not None:
                n = self.spill(result.unrescued, rows, held.packing.borrower.page_size)
                self.stats["spilled_tokens"] = self.stats.get("spilled_tokens", 0) + n
            results.append(result)
        return merged_revokes(results)

    def on_lost(self, ev: LeaseLost, tree: Any) -> Any:
        subs = self._subs(ev.key)
        results = []
        for held in subs:
            key = (held.key.donor, held.key.lease_id)
            self.leases.pop(key, None)
            self._abort_inflight(key, "lease lost")
            results.append(tree.revoke(ev.key.donor, lease_id=held.key.lease_id))
            held.engine.close()
        if subs:
            self._drop_dead_mappings()
        return merged_revokes(results)

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
