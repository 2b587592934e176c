"""Donor hits loaded layer by layer under the forward pass that uses them.

The flow follows SGLang's own external-linker load (`mem_cache/unified_cache/
unified_cache_linker.py`), driven through the plugin's scheduler hooks:

1. admission: `SwiftRadixCache.init_load_back` (called by SGLang's `PrefillAdder` only for a
   request it admits, after its memory checks) allocates slots and begins the tree's load
   ticket, then `queue`s the copy here. The slots are private to the request (as the linker's
   are): `prefix_device_indices` appends them to its prefix, and the request inserts them into
   the tree like computed KV once its forward confirmed them. An exchanged hit (`queue_exchange`:
   the tree has begun swapping it with device victims, `RadixTree.begin_exchange`) is queued the
   same way, its slots the tree's (the victims' former slots, already on the request's path);
2. batch start (`start`, after `Scheduler.get_new_batch_prefill`): the queued copies begin, one
   engine transfer per lease (a load) or per exchange (a swap, `begin_exchange` with the counter:
   layer l of both sides swapped before layer l is released), fanned in to one slot of the pool's
   layer counter
   (`BatchLayerCounter`), whose index becomes the batch's `hicache_consumer_index`; the tp
   worker hands it to the counter before the forward, and each attention layer waits in the
   pool's buffer getter for that layer only;
3. after the forward (`settle`, after `Scheduler.run_batch`): a request whose copy failed (donor
   gone, read deadline passed, pages reclaimed) has its output dropped and never inserts its KV;
   where it can, it then goes back to the waiting queue instead of failing (`load_retry.py`),
   else it is finished with an abort; the others keep theirs. "Failed" includes a copy whose
   bytes were checked after they landed and found invalid (donor gone, lease epoch changed,
   blocks fenced since the copy began): on CPU the copy thread checks each layer before
   releasing it; on a GPU `InFlightCopy.confirm` checks here, once the copy's marker event has
   passed. An exchange's ticket settles here too, once its copy has stopped writing: completed,
   or dropped on both sides with its request's output dropped (`_drop_exchange`). Load tickets
   close once the copies are finished (`poll`, every step): until then the donor nodes stay
   pinned, so their pages are neither dropped nor reused by another store.

The scheduler thread never waits for a copy here; `stats["load_wait_s"]` counts the exceptions
(stopping a copy the forward went past: at most the layer being copied; on a GPU, a copy still
running when its batch settles, waited for before its bytes are judged), `stats["layer_wait_s"]`
the time attention waited for a layer inside the forward (`TimedLayerCounter`). That wait ends
at the batch's deadline, `wait_budget(tokens)` after the batch started: the copies still running
then fail and their requests run again, so a copy that never finishes costs its requests a
second prefill, not the server.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import torch

from radix_ext import slot_runs
from radix_ext.residency import DONOR, HOST

from ..dataplane import streams
from .copies import runs_by_lease, start_copy
from .debug_seam import OBSERVERS
from .layer_fan_in import BatchLayerCounter

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class QueuedLoad:
    """A request's load-back: the tree's `ticket` and the request's private `slots`."""

    req: Any
    ticket: Any
    slots: torch.Tensor
    parts: set = field(default_factory=set)  # fan-in parts (one per lease run) it reads from


@dataclass(eq=False)
class QueuedExchange:
    """A request's donor hit swapped with device victims: the tree's `ExchangeTicket` (in flight
    until this settles) and the hit's slots (the victims' former slots) as SGLang's tensor."""

    req: Any
    ticket: Any
    slots: torch.Tensor
    parts: set = field(default_factory=set)


@dataclass(eq=False)
class BatchLoad:
    fan: BatchLayerCounter
    loads: list
    copies: list  # (part, InFlightCopy)
    wait_mark: float  # the scheduler's waits on copies (stats) when its first load was queued
    overhead_s: float = 0.0  # scheduler-thread time spent starting and settling it
    store_mark: float = 0.0  # the scheduler's time in eviction stores then (stats)


class StreamingLoads:
    """Queued and running load-backs of one cache; runs on the scheduler thread."""

    def __init__(self, cache: Any, runtime: Any, counter: Any, stats: dict,
                 wait_budget: Any = None, host_kv: Any = None):
        self.cache = cache  # its .tree changes on reset
        self.runtime = runtime  # None: no donor tier (a host tier only)
        self.host_kv = host_kv  # host_tier.HostKV, or None: no host tier
        self.counter = counter  # TimedLayerCounter, registered with the pool and tp worker
        self.stats = stats
        # tokens -> seconds a forward may wait for a batch's loads after the batch started
        self.wait_budget = wait_budget or (lambda tokens: counter.timeout_s)
        self._queued: list[QueuedLoad] = []
        self._private: dict[str, torch.Tensor] = {}  # rid -> slots, until the batch is built
        self._wait_mark = self._store_mark = 0.0
        self._running: dict[int, BatchLoad] = {}  # id(batch) -> its load
        self._closing: list[BatchLoad] = []
        # requests whose load failed, with their skip_radix_cache_insert before: taken after
        # their batch's forward (load_retry.py), which may send them back to the waiting queue
        self.failed: list[tuple[Any, bool]] = []

    # ---- 1. admission -----------------------------------------------------------------------
    def queue(self, req: Any, ticket: Any, device: Any) -> None:
        from .cache import indices_to_tensor

        if not self._queued:
            self._wait_mark = self._waited()
            self._store_mark = self.stats["evict_wait_s"]
        slots = indices_to_tensor(ticket.device_indices, device)  # SGLang's tensor, as it is
        self._queued.append(QueuedLoad(req, ticket, slots))
        self._private[req.rid] = slots

    def queue_exchange(self, req: Any, ticket: Any, device: Any) -> None:
        """Queue the copy of an exchange the tree has begun (`RadixTree.begin_exchange`): it
        runs under the request's forward like a load (its hit's slots are the tree's, already in
        the request's prefix) and its ticket settles after that forward."""
        from .cache import indices_to_tensor

        if not self._queued:
            self._wait_mark = self._waited()
            self._store_mark = self.stats["evict_wait_s"]
        self._queued.append(QueuedExchange(req, ticket, indices_to_tensor(ticket.slots, device)))

    def private_slots(self, rid: str) -> torch.Tensor | None:
        """The slots a queued load writes for request `rid` (its prefix after the tree path)."""
        return self._private.get(rid)

    # ---- 2. batch start ---------------------------------------------------------------------
    def start(self, batch: Any) -> None:
        """Begin the queued copies for `batch` (the prefill batch just built)."""
        if not self._queued:
            return
        t0 = time.perf_counter()
        loads, self._queued = self._queued, []
        self._private.clear()  # prepare_for_extend has written them into the request rows
        if batch is None:  # cannot happen: an admitted request is in the batch; stay safe
            self._fail_unstarted(loads, "its batch was not built")
            return
        try:
            fan = BatchLayerCounter(self.counter)
        except RuntimeError as exc:  # every ring slot still loading: a bug, not a reason to die
            logger.error("SwiftCache: cannot start the batch's loads: %s", exc)
            self._fail_unstarted(loads, "no free layer counter slot")
            return
        swaps = [load for load in loads if type(load) is QueuedExchange]
        plain = [load for load in loads if type(load) is QueuedLoad]
        items = [(load, c) for load in plain for c in load.ticket.copies if c.src_tier == DONOR]
        hosted = [(load, c) for load in plain for c in load.ticket.copies if c.src_tier == HOST]
        if hosted:
            self._load_from_host(fan, hosted)
        copies = []
        runs = [(key, [items[i][0] for i in idx],
                 slot_runs.join([items[i][1].dst.indices for i in idx]),
                 [b for i in idx for b in items[i][1].src.blocks], False)
                for key, idx in runs_by_lease([c.src for _, c in items])]
        runs += [(x.ticket.lease[:2], [x], x.ticket.slots, x.ticket.blocks, True) for x in swaps]
        for key, users, slots, blocks, swap in runs:
            copy = start_copy(self.runtime, key, slots, blocks, fan, exchange=swap)
            if copy is None:
                part = fan.fail_part(f"lease {key} is not readable now")
            else:
                part = copy.handle.producer_id
                copies.append((part, copy))
            for load in users:
                load.parts.add(part)
        fan.seal()
        # an exchange moves the hit's bytes twice (both ways)
        tokens = sum(len(load.slots) * (1 + (type(load) is QueuedExchange)) for load in loads)
        self.counter.watch(fan.pid, fan.started_at + self.wait_budget(tokens))
        batch.hicache_consumer_index = fan.pid
        entry = BatchLoad(fan, loads, copies, self._wait_mark, time.perf_counter() - t0,
                          self._store_mark)
        self._running[id(batch)] = entry
        self.stats["loads_started"] += len(plain)

    # ---- 3. after the forward ----------------------------------------------------------------
    def settle(self, scheduler: Any, batch: Any) -> None:
        """The forward of `batch` ran: drop the output of requests whose copy failed."""
        entry = self._running.pop(id(batch), None)
        if entry is None:
            return
        t0 = time.perf_counter()
        batch.hicache_consumer_index = -1  # this batch object may run on as the decode batch
        fan = entry.fan
        late = set(fan.pending_parts())  # the forward went on without them (consumer timeout)
        for part, copy in entry.copies:
            if part in late:
                w0 = time.perf_counter()
                copy.abort("the forward finished before the copy")
                self.stats["load_wait_s"] += time.perf_counter() - w0
        for part, copy in entry.copies:  # after each copy, before its bytes' output is used
            if part in late:
                continue
            w0 = time.perf_counter()
            reason = copy.confirm()  # CPU: checked per layer already; GPU: see confirm
            if copy.marker is not None:  # GPU: an event query, or the copy's remaining time
                self.stats["load_wait_s"] += time.perf_counter() - w0
            if reason is not None:
                fan.invalidate(reason, part)
        failed = fan.failed_parts()
        reasons = {id(load): [failed[p] for p in sorted(load.parts) if p in failed]
                   for load in entry.loads}
        tp = getattr(self.runtime, "tp", None)
        if tp is not None:  # a load that failed on any rank fails on every rank
            elsewhere = tp.all_ok_each([not reasons[id(load)] for load in entry.loads])
            for load, ok in zip(entry.loads, elsewhere):
                if not ok and not reasons[id(load)]:
                    reasons[id(load)] = ["the copy failed on another TP rank"]
        for load in entry.loads:  # every copy has stopped writing: exchanges settle here
            swap = type(load) is QueuedExchange
            if reasons[id(load)]:
                self._fail_request(scheduler, load.req, reasons[id(load)][0])
                if swap:
                    self._drop_exchange(load)
            elif swap:
                self.cache.tree.complete_exchange(load.ticket)
                self.stats["exchanges"] += 1
                self.stats["exchanged_tokens"] += load.ticket.num_tokens
            else:
                self.stats["loaded_tokens"] += len(load.slots)
        entry.overhead_s += time.perf_counter() - t0
        if OBSERVERS.batch_load is not None:  # the debug seam: nothing is built without one
            OBSERVERS.batch_load(self._facts(entry, failed))
        self._closing.append(entry)
        self.poll()

    def poll(self) -> None:
        """Close the tickets of settled loads whose copies are finished (never blocks). With TP
        a ticket closes on every rank at once, when its copies finished on every rank (closing
        it unpins donor nodes, which changes what the tree may evict)."""
        done = [all(c.finished() for _, c in entry.copies) for entry in self._closing]
        tp = getattr(self.runtime, "tp", None)
        if tp is not None and self._closing:
            done = tp.all_ok_each(done)
        still = []
        for entry, finished in zip(self._closing, done):
            if finished:
                self._close(entry)
            else:
                still.append(entry)
        self._closing = still

    def busy(self) -> bool:
        return bool(self._queued or self._running or self._closing)

    def reset(self) -> None:
        """The tree was replaced: stop every copy and forget the loads (their tickets are gone)."""
        for entry in [*self._running.values(), *self._closing]:
            for _, copy in entry.copies:
                copy.abort("the cache was reset")
                copy.release()
        self._queued, self._running, self._closing, self.failed = [], {}, [], []
        self._private.clear()

    # ---- internals ---------------------------------------------------------------------------
    def _load_from_host(self, fan: BatchLayerCounter, hosted: list) -> None:
        """The batch's host segments, one part of its layer fan-in: SGLang's host pool copies
        each layer (`HostKV.load_copies`) on the scheduler's stream, which releases the layer
        as it goes (GPU: enqueued ahead of the forward on the same stream, so attention reads
        it in order, no host wait; CPU: copied here, before the forward)."""
        pid = fan.update_producer()
        for load, _ in hosted:
            load.parts.add(pid)
        stream = streams.current_stream(self.host_kv.device)  # None on a CPU pool
        try:
            self.stats["host_loaded_tokens"] += self.host_kv.load_copies(
                [c for _, c in hosted], lambda layer: fan.complete(layer, pid, stream=stream))
        except Exception as exc:  # noqa: BLE001 - a failed copy aborts its requests
            logger.exception("SwiftCache: a host tier load failed")
            fan.fail(f"host copy failed: {exc}", pid)

    def _close(self, entry: BatchLoad) -> None:
        """Give the tickets back. Their slots stay with the requests, which own them (a failed
        one frees them when it finishes), so nothing the tree returns is freed here."""
        for load in entry.loads:
            if type(load) is QueuedLoad:  # an exchange's ticket settled after its forward
                self.cache.tree.abort_load_back(load.ticket)
        for _, copy in entry.copies:
            copy.release()

    def _fail_unstarted(self, loads: list, reason: str) -> None:
        """The batch's copies cannot start: its requests are aborted (their exchanges dropped:
        nothing was swapped, but the tree already says so)."""
        for load in loads:
            self._fail_request(None, load.req, reason)
            if type(load) is QueuedExchange:
                self._drop_exchange(load)
        self._closing.append(BatchLoad(None, loads, [], self._wait_mark,
                                       store_mark=self._store_mark))

    def _drop_exchange(self, x: QueuedExchange) -> None:
        """An exchange that failed (or never ran): both sides may be half swapped, so the tree
        drops the hit and the victims (`abort_exchange`). The request, already aborted, keeps
        the hit's slots in its row as private slots, as a failed load does: its lock moves from
        the hit to the hit's device parent and the tree-owned part of its row ends there
        (SGLang's own `checkpoint` moves a request's lock this way), so SGLang frees those slots
        with the request, after its forward."""
        t, req = x.ticket, x.req
        lock = getattr(req, "lock", None)
        if lock is not None and any(lock.node is n for n in t.hit):
            self.cache.unlock(lock)
            req.lock = self.cache.lock(t.anchor)
        req.last_node = t.anchor
        kv = getattr(req, "kv", None)
        if kv is not None:
            kv.cache_protected_len = min(kv.cache_protected_len,
                                         len(self.cache.tree.prefix_of(t.anchor)[1]))
        self.cache.slots.free(self.cache.tree.abort_exchange(t, free_hit_slots=False))
        self.stats["exchanges_failed"] += 1

    def take_failed(self) -> list[tuple[Any, bool]]:
        """The requests whose load failed since the last call (see `failed`)."""
        failed, self.failed = self.failed, []
        return failed

    def _fail_request(self, scheduler: Any, req: Any, reason: str) -> None:
        """Finish `req` with an abort before its output is used, as SGLang does for a failed
        external-linker load; its KV never reaches the tree. `load_retry.LoadRetries` then
        turns the abort into a second run where it can."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        self.stats["loads_failed"] += 1
        self.failed.append((req, req.skip_radix_cache_insert))  # load_retry.LoadRetries.take
        req.skip_radix_cache_insert = True
        req.discard_output_reason = FINISH_ABORT(
            f"SwiftCache: loading the cached prefix from a donor failed ({reason}); "
            f"retry the request", HTTPStatus.SERVICE_UNAVAILABLE)
        if scheduler is not None and scheduler.chunked_req is req:
            # its next chunk must not run: released like a client abort (SGLang's own path)
            scheduler._pending_chunked_abort_req = req  # touchpoints.PENDING_CHUNKED_ABORT
        logger.warning("SwiftCache: request %s aborted: donor load failed (%s)", req.rid, reason)

    def _waited(self) -> float:
        """Seconds the scheduler thread waited on copies it did not run itself, so far (stopping
        loads; an eviction's store is its own work, counted in `evict_wait_s`)."""
        return self.stats["load_wait_s"]

    def _facts(self, entry: BatchLoad, failed: dict) -> dict:
        """One batch load, for the debug seam (bench_overlap's timeline, bench_multiturn's
        per-request phases): when each layer was ready for attention and when attention first
        asked for it, from the batch's start; which requests it served, and how (load or
        exchange)."""
        fan = entry.fan
        base = fan.started_at
        reached = self.counter.reached(fan.pid)
        return {
            "t0": time.time() - (fan.clock() - base),  # the batch's start, in Unix time
            "loads": [{"rid": load.req.rid, "tokens": len(load.slots),
                       "kind": "exchange" if type(load) is QueuedExchange else "load"}
                      for load in entry.loads],
            "tokens": sum(len(load.slots) for load in entry.loads),
            "requests": len(entry.loads), "parts": len(entry.copies), "ok": not failed,
            "ready_ms": [None if t is None else (t - base) * 1e3 for t in fan.released_at],
            "reached_ms": [None if t is None else (t - base) * 1e3 for t in reached],
            "scheduler_wait_ms": (self._waited() - entry.wait_mark) * 1e3,
            "store_ms": (self.stats["evict_wait_s"] - entry.store_mark) * 1e3,
            "overhead_ms": entry.overhead_s * 1e3,
        }
