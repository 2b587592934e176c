"""Demotions whose room is there when the eviction returns, without waiting for anything else.

An eviction plans in the tree (`evict_device`): a victim that needs no copy leaves at once, and
a demotion is a `StoreTicket`. SGLang's allocator (`alloc_token_slots`,
`alloc_paged_token_slots_extend`) evicts and allocates in one call and expects the room when
`evict` returns, so each store is made safe to free right away (`copies.store_now`), settled
and its victim's slots freed in the same call:
- CPU: the store runs on the scheduler thread, which is the device there: it costs the
  victims' bytes over memory bandwidth and waits for nothing else (not the copy thread, which
  may be busy with loads, not a peer);
- GPU: the store is enqueued on the lease's side stream and the compute stream waits for its
  event before anything later (a forward rewriting the freed slots) runs; the host waits for
  the enqueue only. The copy stays registered with the runtime until it finished (`poll`), so
  a reclaim of its pages stops it before the reclaim is acknowledged.
A store that cannot run or stops (lease gone, donor lost, read deadline passed) aborts its
ticket: the victim leaves the device without a donor copy (that prefix is recomputed when asked
again), and no residency ever claims donor blocks that were not written. With TP every rank
stores its own shard and a store counts only when it succeeded on every rank.

There are therefore no stores in flight between scheduler steps, nothing to settle later and no
headroom to keep free ahead of need: the device keeps every prefix it has room for.
Scheduler-thread time spent in stores is `stats["evict_wait_s"]` over `stats["evict_waits"]`
evictions that stored something; the longest single one is `stats["evict_store_max_s"]`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from radix_ext import admission, slot_runs
from radix_ext.residency import DONOR, HOST
from radix_ext.results import Released, StoreTicket, Transfer

from ..dataplane.reclaim_staging import gather_rows, read_blocks
from .copies import InFlightCopy, runs_by_lease, store_now
from .debug_seam import OBSERVERS

logger = logging.getLogger(__name__)


class Demotions:
    """The demotions of one borrower's cache; runs on the scheduler thread."""

    def __init__(self, seat: Any, runtime: Any, stats: dict, *, storage: Any,
                 host_kv: Any = None):
        self.seat = seat  # .tree (replaced on reset) and .slots (the device pool)
        self.runtime = runtime  # SwiftRuntime, or runtime.NoRuntime: no donor tier
        self.storage = storage  # StorageHits, or NoStorageHits: no L3
        self.host_kv = host_kv  # host_tier.HostKV, or None: no host tier
        self.stats = stats
        self.stats.setdefault("evict_store_max_s", 0.0)
        self.stats.setdefault("donor_to_host_tokens", 0)
        self.stats.setdefault("donor_to_host_failed_tokens", 0)
        self.stats.setdefault("donor_to_l3_tokens", 0)
        self._enqueued: list[InFlightCopy] = []  # GPU stores still on their side streams

    def make_room(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots if the tree can (fewer if not enough are
        evictable); returns the slots freed, all of them free when this returns. Waits for
        nothing but its own stores' copies (CPU) or enqueues (GPU)."""
        self.poll()
        plan = self.seat.tree.evict_device(num_tokens)
        to_free = []  # runs of device slots (SGLang's tensors: never read on the host)
        stores = []
        moves = []
        for step in plan.steps:
            if type(step) is StoreTicket:
                stores.append(step)
            elif type(step) is Transfer:
                if (step.src_tier, step.dst_tier) != (DONOR, HOST) or self.host_kv is None:
                    raise RuntimeError(f"no data path from {step.src_tier} to {step.dst_tier} "
                                       f"in SwiftCache's server (its tree cascades donor -> "
                                       f"host only, with a host tier)")
                moves.append(step)
            elif type(step) is Released and step.tier == "device":
                to_free.append(step.residency.indices)
        drops = plan.dropped_donor  # named only with L3 below (TreeConfig.l3_below)
        if moves or drops:  # before any store below rewrites the donor blocks they leave
            self._keep_below(moves, drops)
        hosted = [t for t in stores if t.dst_tier == HOST]
        if hosted:
            to_free.append(self._store_host(hosted))
            stores = [t for t in stores if t.dst_tier != HOST]
        if stores:
            to_free.append(self._store(stores))
        freed = slot_runs.join(to_free)
        if len(freed):
            self.seat.slots.free(freed)
        return len(freed)

    def _store(self, stores: list) -> Any:
        """Copy each ticket's victim into its donor blocks, one engine transfer per lease run,
        and settle the tickets; returns the device slots the tree gave back."""
        start = time.perf_counter()
        to_free = []
        for key, idx in runs_by_lease([t.dst for t in stores]):
            tickets = [stores[i] for i in idx]
            slots = slot_runs.join([t.src.indices for t in tickets])
            blocks = [b for t in tickets for b in t.dst.blocks]
            ok, enqueued = store_now(self.runtime, key, slots, blocks)
            if self.runtime.tp is not None:  # a store counts only where every rank stored
                ok = self.runtime.tp.all_ok(ok)
            if enqueued is not None:
                self._enqueued.append(enqueued)
            self.stats["stores_started"] += len(tickets)
            if ok:
                self.stats["stored_tokens"] += len(slots)
                if OBSERVERS.donor_stored is not None and enqueued is None:  # test-only fault
                    OBSERVERS.donor_stored(self.runtime, key, tickets)
            else:  # the donor is not writable now: the eviction drops them instead
                self.stats["refused_stores"] += 1
            to_free.append(admission.settle(self.seat.tree, tickets, [ok] * len(tickets)))
        self._waited(start)
        return slot_runs.join(to_free)

    def _store_host(self, stores: list) -> Any:
        """Copy each ticket's victim into its host slots through SGLang's host pool (one
        `backup_from_device_all_layer` for all of them) and settle the tickets: on the
        scheduler's stream, so on a GPU the forward that rewrites the freed slots runs after
        the copy, and the host does not wait (CPU: copied here)."""
        start = time.perf_counter()
        try:
            self.stats["host_stored_tokens"] += self.host_kv.store_copies(stores)
            ok = True
        except Exception:  # noqa: BLE001 - a failed store drops its victims, never wrong KV
            logger.exception("SwiftCache: a store into the host tier failed; its prefixes are "
                             "dropped and recomputed when asked again")
            ok = False
            self.stats["refused_stores"] += 1
        self.stats["stores_started"] += len(stores)
        to_free = admission.settle(self.seat.tree, stores, [ok] * len(stores))
        if ok:  # L3 takes a copy of what reached host
            for t in stores:
                self.storage.write(t.node)
        self._waited(start)
        return to_free

    def _keep_below(self, moves: list, drops: tuple) -> None:
        """Keep what the eviction pushed out of a full lease: each `Transfer` donor -> host
        (`TreeConfig.cascade` "down") is copied into its host slots, and each dropped donor copy
        (`EvictionPlan.dropped_donor`, with L3 below the host tier) is written to storage
        through the host pool's spill slots, as a reclaim's overflow is. The donor blocks are
        read through each lease's engine into local memory first (CPU engines, on this thread;
        the engine's checks apply: donor alive, lease epoch, read deadline). A move whose read or
        write failed (with TP: on any rank) is taken back from the tree, every move of this
        eviction alike: those prefixes are recomputed, never loaded from rows not written."""
        start = time.perf_counter()
        page = self.seat.tree.page_size
        # a move whose host copy a later step of the plan dropped again: nothing to write
        moves = [m for m in moves if m.node.res.get(HOST) is m.dst]
        threads = torch.get_num_threads()
        error = None
        rows: dict = {}  # lease key -> {block: (Staged, position)}
        blocks: dict = {}  # lease key -> its blocks to read, in order
        for src in [m.src for m in moves] + [d.src for d in drops]:
            blocks.setdefault((src.donor, src.lease), []).extend(src.blocks)
        try:
            for key, wanted in blocks.items():
                engine = self.runtime.lease_engine(*key)
                if engine is None or engine.lane.stream is not None:
                    error = f"lease {key} is not readable here now"
                    break
                torch.set_num_threads(getattr(engine.lane, "threads", 1))
                staged, reason = read_blocks(engine, wanted)
                if staged is None:
                    error = f"lease {key}: {reason}"
                    break
                rows[key] = {b: (staged, i) for i, b in enumerate(staged.blocks)}
            for key, idx in runs_by_lease([m.src for m in moves]) if error is None else ():
                run = [moves[i] for i in idx]
                ks, vs = gather_rows([(m.src, len(m.dst.indices)) for m in run], rows[key], page)
                host = [i for m in run for i in m.dst.indices]
                self.host_kv.write_rows(torch.tensor(host, dtype=torch.int64), ks, vs)
        except Exception as exc:  # noqa: BLE001 - a failed move drops its prefixes, never wrong KV
            error = repr(exc)
        finally:
            torch.set_num_threads(threads)
        ok = error is None
        if self.runtime.tp is not None:
            ok = self.runtime.tp.all_ok(ok)
        tokens = sum(len(m.dst.indices) for m in moves)
        if ok:
            self.stats["donor_to_host_tokens"] += tokens
            for m in moves:  # L3 takes a copy of what reached host
                self.storage.write(m.node)
        elif moves:
            logger.warning("SwiftCache: %d tokens pushed out of donor memory could not be moved "
                           "into the host tier (%s); they are dropped and recomputed when asked "
                           "again", tokens, error or "failed on another TP rank")
            self.stats["donor_to_host_failed_tokens"] += tokens
            self.seat.tree.forget_rescue(moves)
        if drops and error is not None:
            logger.warning("SwiftCache: donor copies dropped from a full lease could not be read "
                           "for L3 (%s); they are recomputed when asked again", error)
        elif drops:
            by_lease: dict = {}
            for d in drops:
                by_lease.setdefault((d.src.donor, d.src.lease), []).append(d)
            for key, part in by_lease.items():
                self.stats["donor_to_l3_tokens"] += self.storage.spill(part, rows[key], page)
        self._waited(start)

    def _waited(self, start: float) -> None:
        """Account the scheduler-thread time since `start` one eviction spent storing."""
        took = time.perf_counter() - start
        self.stats["evict_wait_s"] += took
        self.stats["evict_waits"] += 1
        self.stats["evict_store_max_s"] = max(self.stats["evict_store_max_s"], took)

    def poll(self) -> None:
        """Unregister the GPU stores whose copies finished (never blocks; nothing on CPU)."""
        still = []
        for copy in self._enqueued:
            if copy.finished():
                copy.release()
            else:
                still.append(copy)
        self._enqueued = still

    def reset(self) -> None:
        """The tree was replaced: its tickets were all settled already; stop the GPU copies
        still running (their pages may go back to a lease) and forget them."""
        for copy in self._enqueued:
            copy.abort("the cache was reset")
            copy.release()
        self._enqueued = []
