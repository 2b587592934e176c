"""Prometheus metrics of a SwiftCache server, scraped from SGLang's own `/metrics`.

With `--enable-metrics`, SGLang runs prometheus_client in multiprocess mode (the launcher sets
PROMETHEUS_MULTIPROC_DIR before it spawns the scheduler), and its HTTP server aggregates what every
process writes there. The runtime lives in the scheduler process, so its counters and gauges are
created there, after that variable is set, and appear beside SGLang's `sglang:*` series.
"""

from __future__ import annotations

from typing import Any

from .work_clock import PHASES

COUNTERS = {  # SwiftRuntime.stats key -> (metric name, help)
    "stored_tokens": ("swiftcache_stored_tokens", "tokens copied into donor blocks on demotion"),
    "loaded_tokens": ("swiftcache_loaded_tokens", "tokens loaded back from donor blocks on a hit"),
    "refused_loads": ("swiftcache_refused_loads", "load-backs refused (donor gone or too late)"),
    "refused_stores": ("swiftcache_refused_stores", "demotion copies refused (donor gone or too "
                       "late); the store was aborted"),
    "revoked_tokens": ("swiftcache_revoked_tokens", "cached tokens lost to reclaims or lost "
                       "donors"),
    "leases": ("swiftcache_leases", "leases granted to this server"),
    "reclaims": ("swiftcache_reclaims", "reclaims this server acknowledged"),
    "lost_leases": ("swiftcache_lost_leases", "leases lost to a dead or departed donor"),
    # streaming loads and asynchronous demotion (integration/streaming.py, demotion.py)
    "loads_started": ("swiftcache_loads_started", "donor loads started under a forward pass"),
    "loads_failed": ("swiftcache_loads_failed", "donor loads that failed; their output was "
                     "dropped, and their requests ran again (swiftcache_loads_requeued) or were "
                     "aborted"),
    "loads_requeued": ("swiftcache_loads_requeued", "failed donor loads whose request went "
                       "back to the waiting queue and ran again from the tiers below"),
    "load_retries": ("swiftcache_load_retries", "load admissions retried while room was still "
                     "being demoted (0: stores settle in the eviction)"),
    "loads_declined": ("swiftcache_loads_declined", "donor hits recomputed at admission (the "
                       "tree or the donor changed since the match, or no room)"),
    "hits_unreadable": ("swiftcache_hits_unreadable", "matches whose donor part was not offered: "
                        "its lease was past its read deadline or its donor gone"),
    "stores_started": ("swiftcache_stores_started", "demotions stored by evictions"),
    "exchanges": ("swiftcache_exchanges", "donor hits swapped with device victims (the donor "
                  "tier was full)"),
    "exchanged_tokens": ("swiftcache_exchanged_tokens", "tokens of donor hits swapped with "
                         "device victims"),
    "exchanges_failed": ("swiftcache_exchanges_failed", "exchanges that failed (donor gone, "
                         "reclaimed or late); both sides were dropped and recomputed"),
    "load_wait_s": ("swiftcache_load_wait_seconds", "scheduler-thread time spent waiting on a "
                    "load copy outside the forward (expected 0)"),
    "evict_wait_s": ("swiftcache_evict_wait_seconds", "scheduler-thread time evictions spent "
                     "storing their victims (CPU: copying; GPU: enqueueing)"),
    "evict_waits": ("swiftcache_evict_waits", "evictions that stored a victim"),
    "layer_wait_s": ("swiftcache_layer_wait_seconds", "time attention waited for a layer being "
                     "loaded (the part of the copies the forward did not hide)"),
    # hits and copies by tier (device hits are SGLang's own `sglang:cached_tokens_total`)
    "donor_hit_tokens": ("swiftcache_donor_hit_tokens", "cached tokens admitted from the donor "
                         "tier (loaded under the forward)"),
    "host_hit_tokens": ("swiftcache_host_hit_tokens", "cached tokens admitted from the host "
                        "tier (loaded from SGLang's host pool)"),
    "host_stored_tokens": ("swiftcache_host_stored_tokens", "tokens copied into the host tier "
                           "as they left the device"),
    "host_loaded_tokens": ("swiftcache_host_loaded_tokens", "tokens loaded back from the host "
                           "tier"),
    "rescued_tokens": ("swiftcache_rescued_tokens", "tokens a reclaim moved from donor memory "
                       "into the host tier instead of dropping them"),
    "spilled_tokens": ("swiftcache_spilled_tokens", "tokens a reclaim wrote from donor memory "
                       "straight to L3 storage when the host tier had no room for them"),
    "donor_to_host_tokens": ("swiftcache_donor_to_host_tokens", "tokens an eviction pushed out "
                             "of a full lease and moved from donor memory into the host tier"),
    "donor_to_l3_tokens": ("swiftcache_donor_to_l3_tokens", "tokens an eviction pushed out of a "
                           "full lease that no tier below took, written from donor memory to "
                           "L3 storage"),
    "recomputed_after_reclaim_tokens": ("swiftcache_recomputed_after_reclaim_tokens",
                                        "tokens that were in the donor tier when a reclaim "
                                        "came and that a later request prefilled again"),
    "reclaim_overflow_tokens": ("swiftcache_reclaim_overflow_tokens", "tokens the cache held "
                                "beyond what its device pool, host tier and remaining donor "
                                "memory could hold after a reclaim: what had to go to L3 or be "
                                "dropped, whatever the placement (a host tier too small for "
                                "the reclaims)"),
    "l3_written_pages": ("swiftcache_l3_written_pages", "pages written from the host tier to "
                         "L3 storage (--hicache-storage-backend)"),
    "l3_fetched_tokens": ("swiftcache_l3_fetched_tokens", "tokens read from L3 storage into the "
                          "host tier for a request whose prefix the tree did not hold"),
    "l3_failures": ("swiftcache_l3_failures", "L3 storage queries, reads or writes that "
                    "failed (those pages are recomputed or stay unwritten)"),
    "own_pages_wait_s": ("swiftcache_own_pages_wait_seconds", "donor: scheduler-thread time "
                         "spent waiting (at most 50 ms a time) for lent pages its own requests "
                         "needed"),
}
GAUGES = {
    "kv_pool_tokens": "this server's SGLang KV pool, tokens",
    "lent_tokens": "tokens of this server's own pool lent to other servers now",
    "borrowed_tokens": "tokens of this model's KV that borrowed donor memory can hold now",
    "usable_tokens": "this server's own usable KV capacity now (pool minus lent)",
    "donor_tier_tokens": "cached tokens whose KV is in donor memory now",
    "host_tier_tokens": "cached tokens whose KV is in the host tier now",
    "host_capacity_tokens": "the host tier's size (SGLang's host pool), tokens",
}
RECLAIM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


METRICS_INTERVAL_S = 1.0  # how often the scheduler thread pushes to /metrics


class NoMetrics:
    """A server without --enable-metrics: never due, so nothing is gathered or pushed."""

    def due(self, now: float) -> bool:
        return False


class SwiftMetrics:
    """Counters follow `SwiftRuntime.stats` by deltas; gauges are set on each `update`; the
    scheduler thread pushes when `due` (every METRICS_INTERVAL_S)."""

    def __init__(self, labels: dict[str, str]):
        from prometheus_client import Counter, Gauge, Histogram

        names = sorted(labels)
        self._labels = labels
        self._last: dict[str, int] = {}
        self._counters = {k: Counter(name, help, names).labels(**labels)
                          for k, (name, help) in COUNTERS.items()}
        self._gauges = {k: Gauge("swiftcache_" + k, help, names, multiprocess_mode="mostrecent")
                        .labels(**labels) for k, help in GAUGES.items()}
        self._reclaim = Histogram("swiftcache_reclaim_latency_seconds",
                                  "donor: from asking lent pages back to the last one back in "
                                  "its own pool", names, buckets=RECLAIM_BUCKETS).labels(**labels)
        self._reclaims_seen = 0
        self._work = {phase: Counter(f"swiftcache_work_{phase}_seconds",
                                     f"scheduler-thread time in SwiftCache's code: {help}",
                                     names).labels(**labels) for phase, help in PHASES.items()}
        self._loops = Counter("swiftcache_scheduler_loops", "scheduler loop iterations seen",
                              names).labels(**labels)
        self._work_last: dict[str, float] = {}
        self._loops_last = 0
        self._pushed_at = 0.0

    def due(self, now: float) -> bool:
        """Whether a push is due at `now` (monotonic seconds); if so, it counts as done."""
        if now - self._pushed_at < METRICS_INTERVAL_S:
            return False
        self._pushed_at = now
        return True

    def update_work(self, seconds: dict[str, float], loops: int) -> None:
        """Feed a `work_clock.WorkClock`'s totals (they only grow)."""
        for phase, total in seconds.items():
            delta = total - self._work_last.get(phase, 0.0)
            if delta > 0:
                self._work[phase].inc(delta)
        self._work_last = dict(seconds)
        if loops > self._loops_last:
            self._loops.inc(loops - self._loops_last)
            self._loops_last = loops

    def observe_reclaims(self, latencies: list[float]) -> None:
        """Feed the reclaim latencies recorded since the last call (the list only grows)."""
        for value in latencies[self._reclaims_seen:]:
            self._reclaim.observe(value)
        self._reclaims_seen = len(latencies)

    def update(self, stats: dict[str, int], gauges: dict[str, float]) -> None:
        for key, counter in self._counters.items():
            delta = stats.get(key, 0) - self._last.get(key, 0)
            if delta > 0:
                counter.inc(delta)
        self._last = dict(stats)
        for key, value in gauges.items():
            self._gauges[key].set(value)


def tier_tokens(tree: Any) -> dict[str, int]:
    """The tree's lower tiers now (what /metrics, `ctl status` and the log show): cached tokens
    in donor memory and in the host tier, and the host tier's size; 0 for a tier it lacks."""
    from radix_ext import DONOR, HOST

    if tree is None:  # a server on SGLang's own tree (a hybrid donor) keeps no lower tiers
        return {"donor_tier_tokens": 0, "host_tier_tokens": 0, "host_capacity_tokens": 0}
    return {"donor_tier_tokens": tree.tier_size(DONOR) if tree.donor is not None else 0,
            "host_tier_tokens": tree.tier_size(HOST) if tree.host is not None else 0,
            "host_capacity_tokens": tree.host.capacity_tokens() if tree.host is not None else 0}


def gauges_of(runtime: Any, tree: Any, pool_tokens: int) -> dict[str, float]:
    """The gauges of a server: `runtime` None for one without a control channel."""
    out = {"kv_pool_tokens": pool_tokens, "lent_tokens": 0, "borrowed_tokens": 0,
           "usable_tokens": pool_tokens, **tier_tokens(tree)}
    if runtime is not None:
        out.update(lent_tokens=runtime.lent_tokens, borrowed_tokens=runtime.borrowed_tokens(),
                   usable_tokens=runtime.usable_tokens())
    return out
