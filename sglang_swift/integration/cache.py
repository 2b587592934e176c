"""`SwiftRadixCache`: SGLang 0.5.23's prefix-cache interface in front of a `radix_ext.RadixTree`.

It subclasses SGLang's Python `RadixCache` for the request-level flow it already gets right
(`checkpoint`, which inserts, frees duplicates, re-matches and moves the request's lock) and
replaces every operation on the tree itself (match, insert, evict, lock, sizes, path indices)
with radix_ext. Node handles given to the scheduler are radix_ext nodes. Tensors cross the
boundary in `cache_tree.py`: radix_ext holds `array('q')` slot indices.

The cache holds named collaborators, built before it (`build.py`, the one construction path)
and passed in; a capability the server lacks is a null object, so no method asks which tiers
exist:
- `seat` (`cache_tree.CacheTree`): the current tree and SGLang's device slots, shared with the
  collaborators (`reset` replaces the tree);
- `donor_hits` (`donor_hits.DonorHits`, or `NoDonorHits` without donor and host tier): lower-tier
  hits and the room made for the device. A match reports the donor and host part as a
  lower-tier hit (`host_hit_length`, as HiCache does); SGLang's `PrefillAdder` calls
  `init_load_back` only for a request it admits, which allocates the slots and queues the copy;
  the copy runs layer by layer under the batch's forward (`streaming.py`), and a request whose
  copy failed is aborted, never answered from bad KV. An eviction's demotions are stored before
  it returns, so their slots are free at once (`demotion.py`);
- `storage_hits` (`storage_hits.StorageHits`, or `NoStorageHits` without L3): what SGLang's
  scheduler calls on a tree with `--hicache-storage-backend`;
- `control` (`runtime.SwiftRuntime` when the server lends or borrows, else `runtime.NoRuntime`):
  the control channel, lending and borrowing (`runtime` names the first, None for the second);
- `metrics` (`metrics.SwiftMetrics` with --enable-metrics, else `metrics.NoMetrics`).
Admission (match, lock, allocate evicting, re-match, begin load-back) is radix_ext's
(`radix_ext.admission`), shared with the simulator and `bench_tree`.

Control events (leases, reclaims, lost donors) are handled once per scheduler loop iteration
(`swift_step`, called by the plugin's hook), never inside a match or an eviction. Faults are
expected events: a copy that cannot run (donor gone, read deadline passed) aborts its ticket,
so the request recomputes those tokens; nothing reads a block after its lease ended.
"""

from __future__ import annotations

import logging
import time
from array import array
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from radix_ext import DEVICE, slot_runs

from .cache_tree import CacheTree, indices_to_tensor, namespace_of
from .runtime import ControlStep, NoRuntime
from .work_clock import WorkClock, timed

logger = logging.getLogger(__name__)
REPORT_INTERVAL_S = 5.0
STREAM_STATS = ("load_wait_s", "evict_wait_s", "evict_waits", "layer_wait_s", "loads_started",
                "loads_failed", "loads_requeued", "load_retries", "loads_declined",
                "hits_unreadable", "stores_started", "exchanges", "exchanged_tokens",
                "exchanges_failed", "host_stored_tokens", "host_loaded_tokens", "host_hit_tokens",
                "donor_hit_tokens", "rescued_tokens", "spilled_tokens",
                "recomputed_after_reclaim_tokens", "l3_written_pages", "l3_fetched_tokens",
                "l3_failures")
# a tree without a runtime (no lending or borrowing) but with a host tier counts these itself
LOCAL_STATS = ("stored_tokens", "loaded_tokens", "refused_loads", "refused_stores")


class SwiftRadixCache(RadixCache):
    """SGLang's radix cache interface, radix_ext inside, over the collaborators described in
    the module docstring (`build.build_cache` makes them). `stats` are the counters of loads
    and stores (the runtime's with a control channel: one dict for every collaborator)."""

    def __init__(self, params: CacheInitParams, seat: CacheTree, *, donor_hits: Any,
                 storage_hits: Any, control: Any, metrics: Any, stats: dict):
        if params.is_eagle:
            raise ValueError("SwiftCache's tree does not support EAGLE (bigram keys) yet; "
                             "run without --enable-swiftcache or without speculative decoding")
        self.seat = seat
        self.tree_config = seat.config
        self.donor_hits = donor_hits
        self.storage_hits = storage_hits
        self.control = control  # SwiftRuntime, or NoRuntime
        self.metrics = metrics
        self.stats = stats
        self.hicache_storage_pass_prefix_keys = storage_hits.pass_prefix_keys
        self.work = WorkClock()
        self._built = False  # SGLang's constructor resets once: the seat's tree is new already
        super().__init__(params)  # calls self.reset()
        self._built = True
        self._last_report = 0.0
        self._control_step = ControlStep()
        self._reported: dict = {}

    @property
    def tree(self) -> Any:
        return self.seat.tree

    @property
    def runtime(self) -> Any:
        """The server's `SwiftRuntime`; None when it neither lends nor borrows."""
        return None if isinstance(self.control, NoRuntime) else self.control

    # ---- lifecycle ----------------------------------------------------------------------------

    def reset(self) -> None:
        if self._built:  # SGLang's flush: a new, empty tree
            self.storage_hits.reset()  # no I/O may touch host slots the new tree hands out
            self.donor_hits.reset()  # the tickets in flight go with the old tree
            self.control.attach_tree(self.seat.reset())  # hand it the leases still held
        self.root_node = self.tree.root
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self._empty_device_indices = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._empty_match_result = MatchResult(
            device_prefix_len=0,
            last_device_node=self.root_node,
            last_host_node=self.root_node,
            best_match_node=self.root_node,
        )
        self.kv_events.record_all_cleared()

    @timed("loop")
    def swift_step(self, scheduler: Any = None) -> None:
        """Called once per scheduler loop iteration (plugin hook): close finished copies and
        handle control events (`runtime.ControlStep`), so an idle server still takes
        leases and reclaims; with TP also at once when rank 0's agent woke the loop for them
        (`loop_wake.py`: an idle scheduler asleep in SGLang's poll runs this step at once)."""
        self.work.loops += 1
        if scheduler is not None:
            self.donor_hits.requeue(scheduler)
        self.donor_hits.poll()
        self.storage_hits.poll()
        now = time.monotonic()
        self._control_step(self.control, scheduler, now)
        self._update_metrics(now)
        self._report(now)

    def _update_metrics(self, now: float) -> None:
        """Push the counters and gauges to /metrics when due (`metrics.METRICS_INTERVAL_S`)."""
        if not self.metrics.due(now):
            return
        from .metrics import gauges_of

        self.metrics.update_work(self.work.seconds, self.work.loops)
        self.metrics.update(self.stats, gauges_of(self.runtime, self.tree,
                                                  self.token_to_kv_pool_allocator.size))
        self.metrics.observe_reclaims(self.control.reclaim_latencies)

    def _report(self, now: float) -> None:
        """Log the counters every REPORT_INTERVAL_S while they change."""
        if now - self._last_report >= REPORT_INTERVAL_S and self.stats != self._reported:
            from .metrics import tier_tokens

            self._last_report, self._reported = now, dict(self.stats)
            tiers = tier_tokens(self.tree)
            logger.info("SwiftCache stats: %s; donor tier %d tokens, host tier %d tokens",
                        self._reported, tiers["donor_tier_tokens"], tiers["host_tier_tokens"])

    # ---- tree operations ----------------------------------------------------------------------

    @timed("match")
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """One match of the tree. The donor and host part, up to its first lease not readable
        now, is a lower-tier hit: nothing is allocated or copied until `init_load_back`."""
        key = params.key
        if self.disable or len(key) == 0:
            return self._empty_match_result
        tokens = key.raw_token_ids()
        m = self.tree.match(tokens, namespace_of(key))
        length = m.device_len
        hit, best = self.donor_hits.lower_hit(m)
        if length == 0 and hit == 0:
            return self._empty_match_result
        return MatchResult(device_prefix_len=length, last_device_node=m.last_device_node,
                           last_host_node=best, best_match_node=best, host_hit_length=hit)

    def touch_prefix(self, key: RadixKey) -> None:
        if not self.disable and len(key):
            self.tree.match(key.raw_token_ids(), namespace_of(key))

    @timed("insert")
    def insert(self, params: InsertParams) -> InsertResult:
        if self.disable:
            return InsertResult(prefix_len=0)
        key = params.key
        tokens = key.raw_token_ids()
        n = len(tokens) - len(tokens) % self.page_size
        if params.value is None:  # debug/test path, as in SGLang: the tokens stand in for slots
            slots = indices_to_tensor(array("q", tokens[:n]), self.device)
        else:  # SGLang's device tensor, kept as the tree's handle: its values are never read
            slots = params.value[:n].to(torch.int64)
        r = self.tree.insert(tokens[:n], slots, namespace_of(key))
        lost = self.control.reclaim_loss
        if lost:
            # tokens new to the tree were prefilled (what a request loaded from host or L3 was
            # in the tree before its prefill): those of a prefix a reclaim dropped are recomputed
            self.stats["recomputed_after_reclaim_tokens"] += \
                lost.recomputed(tokens[:n], namespace_of(key), r.prefix_len)
        if params.value is not None:  # computed KV (write-through copies it to host)
            self.donor_hits.inserted(r.last_node)
        # SGLang's caller frees its slots in [cache_protected_len, prefix_len): the duplicates.
        return InsertResult(prefix_len=r.duplicate_len, last_device_node=r.last_node)

    @timed("evict")
    def evict(self, params: EvictParams) -> EvictResult:
        """Evict through the tree. SGLang's allocator needs the room when this returns: a
        borrower's demotions are copied (CPU) or enqueued (GPU) before it does (their time is
        `stats["evict_wait_s"]`)."""
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()
        num_evicted = self.donor_hits.make_room(params.num_tokens)
        self.update_eviction_metrics(num_evicted, start)
        return EvictResult(num_tokens_evicted=num_evicted)

    def evict_tokens(self, num_tokens: int) -> int:
        """`evict` for a donor's lending (`SwiftRuntime.start`): the tokens evicted."""
        return self.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted

    @timed("lock")
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        return IncLockRefResult(delta=self.seat.lock_delta(node, True))

    @timed("lock")
    def dec_lock_ref(self, node: Any,
                     params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        if self.disable:
            return DecLockRefResult(delta=0)
        return DecLockRefResult(delta=self.seat.lock_delta(node, False))

    def path_device_indices(self, node: Any) -> torch.Tensor:
        if node is self.root_node:
            return self._empty_device_indices
        return indices_to_tensor(self.tree.device_indices(node), self.device)

    # ---- lower-tier hits (donor_hits.py) ------------------------------------------------------

    @timed("load_back")
    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any]:
        return self.donor_hits.init_load_back(params)

    def load_back_is_cache_owned(self) -> bool:
        return self.donor_hits.load_back_is_cache_owned()

    def prefix_device_indices(self, req: Any) -> torch.Tensor:
        path = self.path_device_indices(req.last_node)
        tail = self.donor_hits.private_slots(req.rid)
        if tail is not None:  # a streamed load's slots, the request's until its forward
            path = torch.cat([path, tail])
        assert len(path) >= req.prefix_len, (req.rid, len(path), req.prefix_len)
        return path[: req.prefix_len]

    @timed("batch_start")
    def swift_batch_built(self, batch: Any) -> None:
        """A prefill batch was built (plugin hook): start the loads its requests queued."""
        self.donor_hits.batch_built(batch)

    @timed("batch_settle")
    def swift_batch_ran(self, scheduler: Any, batch: Any) -> None:
        """A batch's forward ran (plugin hook): drop the output of requests whose load failed."""
        self.donor_hits.batch_ran(scheduler, batch)

    # ---- L3 (storage_hits.py): what the scheduler calls with --hicache-storage-backend -------

    def is_backuped(self, node: Any) -> bool:
        """Every node can anchor a fetch: its storage keys come from its path's tokens."""
        return True

    def get_last_hash_value(self, node: Any) -> Optional[str]:
        """Unused by this tree (a fetch derives its keys from the request's tokens)."""
        return None

    def get_prefix_hash_values(self, node: Any) -> list:
        return self.storage_hits.prefix_hash_values(node)

    def prefetch_from_storage(self, request: Any, last_host_node: Any, new_input_tokens: Any,
                              last_hash: Optional[str] = None, prefix_keys: Any = None,
                              matched_prefix_tokens: Any = None, extra_key: Any = None,
                              cache_salt: Any = None, storage_hit_end: Any = None) -> None:
        self.storage_hits.prefetch(request, list(matched_prefix_tokens or []), new_input_tokens,
                                   extra_key, cache_salt)

    def check_prefetch_progress(self, request: Any) -> bool:
        return self.storage_hits.check_progress(request)

    def pop_prefetch_loaded_tokens(self, request: Any) -> int:
        return self.storage_hits.pop_loaded_tokens(request)

    def release_aborted_request(self, request: Any) -> None:
        self.storage_hits.release_aborted(request)

    # ---- sizes and inspection -----------------------------------------------------------------

    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def protected_size(self) -> int:
        """Locked tree tokens plus the pages this server lent out of its pool: those are neither
        free nor evictable, and SGLang's idle check (available + evictable + protected == pool)
        must see them as in use."""
        # device slots of prefixes leaving the device (0 between evictions: stores settle in
        # the eviction that began them)
        return (self.tree.protected_size() + self.tree.leaving_size()
                + self.control.lent_tokens)

    def total_size(self) -> int:
        return self.tree.device_size()

    def all_values_flatten(self) -> torch.Tensor:
        out = []
        stack = list(self.root_node.children.values())
        while stack:
            x = stack.pop()
            res = x.res.get(DEVICE)
            if res is not None:
                out.append(res.indices)
                stack.extend(x.children.values())
        return indices_to_tensor(slot_runs.join(out), self.device)

    def pretty_print(self) -> None:
        stack = [(self.root_node, 0)]
        while stack:
            x, depth = stack.pop()
            print(" " * depth, len(x.key), list(x.key[:10]), sorted(x.res), f"r={x.lock_ref}")
            stack.extend((c, depth + 2) for c in x.children.values())
        print(f"#tokens: {self.total_size()}")

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        self.control.agent.check_integrity()
