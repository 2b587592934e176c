"""`SwiftRadixCache`: SGLang 0.5.23's prefix-cache interface in front of a `radix_ext.RadixTree`.

It subclasses SGLang's Python `RadixCache` for the request-level flow it already gets right
(`checkpoint`, which inserts, frees duplicates, re-matches and moves the request's lock) and
replaces every operation on the tree itself (match, insert, evict, lock, sizes, path indices)
with radix_ext. Node handles given to the scheduler are radix_ext nodes. Tensors cross the
boundary here and only here: radix_ext holds `array('q')` slot indices.

`runtime` is None unless the server lends or borrows (`SwiftConfig.uses_donation`); the tree
then has no lower tier and makes the same decisions as SGLang's own LRU radix tree. A borrower's
tree has a donor tier fed by leases of other SwiftCache servers' pool pages, and nothing on the
scheduler thread waits for a copy into or out of it:
- a match reports the donor part as a lower-tier hit (`host_hit_length`, as HiCache does);
  SGLang's `PrefillAdder` calls `init_load_back` only for a request it admits, which allocates
  the slots and queues the copy; the copy runs layer by layer under the batch's forward
  (`streaming.py`), and a request whose copy failed is aborted, never answered from bad KV;
- an eviction's demotions are stored before it returns, so their slots are free at once: on CPU
  the scheduler thread copies the victims (bytes over memory bandwidth), on a GPU it enqueues
  the copies and the compute stream waits for them (`demotion.py`).
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
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from radix_ext import DEVICE, HOST, DevicePool, RadixTree, TreeConfig, slot_runs

from ..dataplane.pool_rows import to_device
from .donor_hits import DonorHitsMixin
from .storage_hits import StorageHitsMixin
from .work_clock import WorkClock, timed

logger = logging.getLogger(__name__)
STEP_INTERVAL_S = 0.02
REPORT_INTERVAL_S = 5.0
METRICS_INTERVAL_S = 1.0
STREAM_STATS = ("load_wait_s", "evict_wait_s", "evict_waits", "layer_wait_s", "loads_started",
                "loads_failed", "load_retries", "loads_declined", "hits_unreadable",
                "stores_started", "exchanges", "exchanged_tokens", "exchanges_failed",
                "host_stored_tokens", "host_loaded_tokens", "host_hit_tokens", "donor_hit_tokens",
                "rescued_tokens", "spilled_tokens", "recomputed_after_reclaim_tokens",
                "l3_written_pages",
                "l3_fetched_tokens", "l3_failures")
# a tree without a runtime (no lending or borrowing) but with a host tier counts these itself
LOCAL_STATS = ("stored_tokens", "loaded_tokens", "refused_loads", "refused_stores")


def tensor_to_indices(t: torch.Tensor) -> array:
    """int64 slot indices as an array('q') (one copy through host memory: for host tensors;
    a device tensor's values read here would make the host wait for the GPU)."""
    out = array("q")
    if t.numel():
        out.frombytes(t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return out


def indices_to_tensor(a: Any, device: torch.device) -> torch.Tensor:
    """Slot indices as an int64 tensor on `device`: a tensor (SGLang's, as the tree holds it)
    as it is; host indices (`array('q')`: the debug insert, the tests) through one asynchronous
    copy (pinned on a GPU)."""
    if isinstance(a, torch.Tensor):
        return a
    if not len(a):
        return torch.empty((0,), dtype=torch.int64, device=device)
    return to_device(torch.frombuffer(a, dtype=torch.int64).clone(), device)


def namespace_of(key: RadixKey) -> Any:
    """The isolation namespace SGLang gives a key (LoRA id, cache salt); None when plain."""
    if key.extra_key is None and key.cache_salt is None:
        return None
    return (key.extra_key, key.cache_salt)


class KVSlots(DevicePool):
    """SGLang's KV slot allocator as radix_ext's admission sees it. Slots go back with
    `free_segment` (page-aligned runs, as SGLang's own eviction frees them); a borrower's room is
    made by `Demotions` (its stores copied or enqueued before it returns)."""

    def __init__(self, cache: "SwiftRadixCache"):
        self.cache = cache

    def available(self) -> int:
        return self.cache.token_to_kv_pool_allocator.available_size()

    def alloc(self, num_tokens: int) -> Optional[torch.Tensor]:
        return self.cache.token_to_kv_pool_allocator.alloc(num_tokens)  # device tensor, kept

    def free(self, indices: Any) -> None:
        if len(indices):
            self.cache.token_to_kv_pool_allocator.free_segment(
                indices_to_tensor(indices, self.cache.device), start_pos=0)

    def make_room(self, tree: Any, num_tokens: int) -> int:
        if self.cache.demotions is None:
            return super().make_room(tree, num_tokens)
        return self.cache.demotions.make_room(num_tokens)


class SwiftRadixCache(StorageHitsMixin, DonorHitsMixin, RadixCache):
    """SGLang's radix cache interface, radix_ext inside. `tree_config` picks page size, policies
    and tiers; `config` (a `SwiftConfig`) starts a `SwiftRuntime` when the server lends or
    borrows; `model`, `agent_id` and `enable_metrics` describe it then. A borrower registers its
    layer counter with the KV pool and `tp_worker`. `storage` (a `storage_tier.StorageTier`,
    with `host_kv` only) is L3 below the host tier (`storage_hits.py`)."""

    def __init__(self, params: CacheInitParams, tree_config: TreeConfig, config: Any = None, *,
                 model: str = "", agent_id: Optional[str] = None, enable_metrics: bool = False,
                 tp_worker: Any = None, host_kv: Any = None, storage: Any = None,
                 tp: Any = None):
        if params.is_eagle:
            raise ValueError("SwiftCache's tree does not support EAGLE (bigram keys) yet; "
                             "run without --enable-swiftcache or without speculative decoding")
        if bool(tree_config.host_capacity) != (host_kv is not None) or (
                host_kv is not None and tree_config.host_capacity > host_kv.capacity):
            raise ValueError("the tree's host tier needs host memory of its size: pass host_kv "
                             "(host_tier.HostKV) and host_capacity <= host_kv.capacity, or "
                             "neither")
        if storage is not None and host_kv is None:
            raise ValueError("L3 storage sits below the host tier: pass host_kv with storage")
        slot_runs.register(torch.Tensor, torch.cat)  # the tree joins SGLang's slot tensors
        self.tree_config = tree_config
        self.tp = tp  # tp_sync.TpGroup of a lending or borrowing server with --tp > 1
        self.host_kv = host_kv
        self._init_storage(storage)
        self.runtime = self.loads = self.demotions = None
        self.work = WorkClock()
        super().__init__(params)  # calls self.reset()
        self.slots = KVSlots(self)
        self.metrics = None
        self._own_stats: dict = {}
        self._last_step = self._last_report = self._last_metrics = 0.0
        self._watch_loop = True  # runtime.watch_loop at the first step given the scheduler
        self._reported: dict = {}
        if config is not None and config.uses_donation:
            self._start_runtime(config, model, agent_id, enable_metrics, tp_worker)
        elif host_kv is not None:  # a host tier alone: loads and stores, no control channel
            self._own_stats = {k: 0 for k in (*LOCAL_STATS, *STREAM_STATS)}
            self._start_streaming(config, self.token_to_kv_pool_allocator.get_kvcache(),
                                  tp_worker)
            if enable_metrics:
                self._start_metrics(agent_id or model or "server", "host")
        elif enable_metrics:  # the tree alone: its own work and tiers
            self._start_metrics(agent_id or model or "server", "none")

    def _start_runtime(self, config: Any, model: str, agent_id: Optional[str],
                       enable_metrics: bool, tp_worker: Any) -> None:
        from .runtime import SwiftRuntime

        kv_pool = self.token_to_kv_pool_allocator.get_kvcache()
        self.runtime = SwiftRuntime(config, model=model, kv_pool=kv_pool,
                                    allocator=self.token_to_kv_pool_allocator, tree=self.tree,
                                    page_size=self.page_size, agent_id=agent_id, tp=self.tp)
        self.runtime.stats.update({k: 0 for k in STREAM_STATS})
        self.runtime.make_room = \
            lambda n: self.evict(EvictParams(num_tokens=n)).num_tokens_evicted
        if self.host_kv is not None and config.borrows:  # a reclaimed donor page goes to host
            from ..dataplane.reclaim_staging import ReclaimStaging

            self.runtime.borrowing.staging = ReclaimStaging(self.host_kv.write_rows)
            if self.storage is not None:  # what a reclaim moved into host goes on to L3
                self.runtime.on_rescued = lambda nodes: [self._write_to_storage(x)
                                                         for x in nodes]
                if self.host_kv.spill_slots is not None:  # and what found no room there too
                    self.runtime.borrowing.spill = self._spill_to_storage
        if config.borrows or self.host_kv is not None:
            self._start_streaming(config, kv_pool, tp_worker)
        if enable_metrics:
            self._start_metrics(self.runtime.agent_id, config.role)
        self.runtime.start()

    def _start_metrics(self, agent: str, role: str) -> None:
        """SGLang's --enable-metrics: our series join its /metrics."""
        from .metrics import SwiftMetrics

        self.metrics = SwiftMetrics({"agent": agent, "role": role})

    @property
    def stats(self) -> dict:
        """The counters of loads and stores: the runtime's when there is one (with the control
        channel's), else the tree's own (a host tier alone)."""
        return self.runtime.stats if self.runtime is not None else self._own_stats

    # ---- lifecycle ----------------------------------------------------------------------------

    def reset(self) -> None:
        if self.storage is not None and getattr(self, "tree", None) is not None:
            self._drain_storage()  # no I/O may touch host slots the new tree hands out
        if self.loads is not None:  # the tickets in flight go with the old tree
            self.loads.reset()
            self.demotions.reset()
        self.tree = RadixTree(self.tree_config)
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
        if self.runtime is not None:  # a new, empty tree: hand it the leases still held
            self.runtime.attach_tree(self.tree)

    @timed("loop")
    def swift_step(self, scheduler: Any = None) -> None:
        """Called once per scheduler loop iteration (plugin hook): close finished copies and
        handle control events at most every STEP_INTERVAL_S, so an idle server still takes
        leases and reclaims; with TP also at once when rank 0's agent woke the loop for them
        (`loop_wake.py`: an idle scheduler asleep in SGLang's poll runs this step at once)."""
        self.work.loops += 1
        if self.loads is not None:
            self.demotions.poll()
            self.loads.poll()
            self.stats["layer_wait_s"] = self.counter.wait_s
        self._poll_storage()
        now = time.monotonic()
        if self.runtime is None:
            self._update_metrics(now)
            self._report(now)
            return
        if self._watch_loop and scheduler is not None:  # the first step with the scheduler
            self._watch_loop = False
            self.runtime.watch_loop(scheduler)
        # woken first (drained every step): TP rank 0's agent woke the loop for an event that
        # waits for the pump (a reclaim), so this step pumps whenever the last one was
        due = self.runtime.woken()
        due = due or now - self._last_step >= STEP_INTERVAL_S
        if due:
            self._last_step = now
        if due or self.tp is not None:  # TP: every loop, rank 0's `due` decides for all
            self.runtime.pump(due)
        self.runtime.lend(scheduler)  # every loop: a burst's demand leaves in the loop it arrived
        self._update_metrics(now)
        self._report(now)

    def _update_metrics(self, now: float) -> None:
        """Push the counters and gauges to /metrics every METRICS_INTERVAL_S."""
        if self.metrics is None or now - self._last_metrics < METRICS_INTERVAL_S:
            return
        from .metrics import gauges_of

        self._last_metrics = now
        self.metrics.update_work(self.work.seconds, self.work.loops)
        self.metrics.update(self.stats, gauges_of(self.runtime, self.tree,
                                                  self.token_to_kv_pool_allocator.size))
        if self.runtime is not None and self.runtime.lender is not None:
            self.metrics.observe_reclaims(self.runtime.lender.reclaim_latencies)

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
        """One match of the tree. The donor part, up to its first lease not readable now, is a
        lower-tier hit: nothing is allocated or copied until `init_load_back`."""
        key = params.key
        if self.disable or len(key) == 0:
            return self._empty_match_result
        tokens = key.raw_token_ids()
        m = self.tree.match(tokens, namespace_of(key))
        length, node = m.device_len, m.last_device_node
        hit, best = self._lower_hit(m) if self.loads is not None else (0, node)
        if length == 0 and hit == 0:
            return self._empty_match_result
        return MatchResult(device_prefix_len=length, last_device_node=node,
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
        if self.runtime is not None and self.runtime.reclaim_loss:
            # tokens new to the tree were prefilled (what a request loaded from host or L3 was
            # in the tree before its prefill): those of a prefix a reclaim dropped are recomputed
            self.stats["recomputed_after_reclaim_tokens"] += \
                self.runtime.reclaim_loss.recomputed(tokens[:n], namespace_of(key), r.prefix_len)
        if self.host_kv is not None and self.host_kv.write_through and params.value is not None:
            self._write_through(r.last_node)
        # SGLang's caller frees its slots in [cache_protected_len, prefix_len): the duplicates.
        return InsertResult(prefix_len=r.duplicate_len, last_device_node=r.last_node)

    def _write_through(self, node: Any) -> None:
        """--hicache-write-policy write_through: host copies of the path the tree just took,
        through SGLang's host pool on the scheduler's stream (GPU: ordered before anything that
        could rewrite the device rows, no host wait; CPU: copied here). A copy that fails is
        taken back: the prefix is then on the device only, as under write_back."""
        transfers, _ = self.tree.back_up(node, HOST)
        if not transfers:
            return
        try:
            self.stats["host_stored_tokens"] += self.host_kv.store_copies(transfers)
        except Exception:  # noqa: BLE001 - the host copy is an optimisation; the device has it
            logger.exception("SwiftCache: a write-through copy into the host tier failed")
            self.tree.forget_backup(transfers)
            return
        self._write_to_storage(node)

    @timed("evict")
    def evict(self, params: EvictParams) -> EvictResult:
        """Evict through the tree. SGLang's allocator needs the room when this returns: a
        borrower's demotions are copied (CPU) or enqueued (GPU) before it does (their time is
        `stats["evict_wait_s"]`)."""
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()
        num_evicted = self.slots.make_room(self.tree, params.num_tokens)
        self.update_eviction_metrics(num_evicted, start)
        return EvictResult(num_tokens_evicted=num_evicted)

    @timed("lock")
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        before = self.tree.evictable_size()
        self.tree.lock(node)
        return IncLockRefResult(delta=self.tree.evictable_size() - before)

    @timed("lock")
    def dec_lock_ref(self, node: Any,
                     params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        if self.disable:
            return DecLockRefResult(delta=0)
        before = self.tree.evictable_size()
        self.tree.unlock(node)
        return DecLockRefResult(delta=self.tree.evictable_size() - before)

    def path_device_indices(self, node: Any) -> torch.Tensor:
        if node is self.root_node:
            return self._empty_device_indices
        return indices_to_tensor(self.tree.device_indices(node), self.device)

    # ---- sizes and inspection -----------------------------------------------------------------

    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def protected_size(self) -> int:
        """Locked tree tokens plus the pages this server lent out of its pool: those are neither
        free nor evictable, and SGLang's idle check (available + evictable + protected == pool)
        must see them as in use."""
        lent = self.runtime.lent_tokens if self.runtime is not None else 0
        # device slots of prefixes leaving the device (0 between evictions: stores settle in
        # the eviction that began them)
        return self.tree.protected_size() + self.tree.leaving_size() + lent

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
        if self.runtime is not None:
            self.runtime.agent.check_integrity()
