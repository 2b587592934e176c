"""Prometheus metrics of a SwiftCache server, scraped from SGLang's own `/metrics`.

With `--enable-metrics`, SGLang runs prometheus_client in multiprocess mode (the launcher sets
PROMETHEUS_MULTIPROC_DIR before it spawns the scheduler), and its HTTP server aggregates what every
process writes there. The runtime lives in the scheduler process, so its counters and gauges are
created there, after that variable is set, and appear beside SGLang's `sglang:*` series.
"""

from __future__ import annotations

from typing import Any

COUNTERS = {  # SwiftRuntime.stats key -> (metric name, help)
    "stored_tokens": ("swiftcache_stored_tokens", "tokens copied into donor blocks on demotion"),
    "loaded_tokens": ("swiftcache_loaded_tokens", "tokens loaded back from donor blocks on a hit"),
    "refused_loads": ("swiftcache_refused_loads", "load-backs refused (donor gone or too late)"),
    "refused_stores": ("swiftcache_refused_stores", "demotion copies refused (donor gone or too "
                       "late); the store was aborted"),
    "revoked_tokens": ("swiftcache_revoked_tokens", "cached tokens lost to reclaims or lost donors"),
    "leases": ("swiftcache_leases", "leases granted to this server"),
    "reclaims": ("swiftcache_reclaims", "reclaims this server acknowledged"),
    "lost_leases": ("swiftcache_lost_leases", "leases lost to a dead or departed donor"),
}
GAUGES = {
    "borrowed_blocks": "donor blocks this server holds now",
    "lent_blocks": "blocks of this server's arena lent to others now",
    "donor_tier_tokens": "cached tokens whose KV is in donor blocks now",
}


class SwiftMetrics:
    """Counters follow `SwiftRuntime.stats` by deltas; gauges are set on each `update`."""

    def __init__(self, labels: dict[str, str]):
        from prometheus_client import Counter, Gauge

        names = sorted(labels)
        self._labels = labels
        self._last: dict[str, int] = {}
        self._counters = {k: Counter(name, help, names).labels(**labels)
                          for k, (name, help) in COUNTERS.items()}
        self._gauges = {k: Gauge("swiftcache_" + k, help, names, multiprocess_mode="mostrecent")
                        .labels(**labels) for k, help in GAUGES.items()}

    def update(self, stats: dict[str, int], gauges: dict[str, float]) -> None:
        for key, counter in self._counters.items():
            delta = stats.get(key, 0) - self._last.get(key, 0)
            if delta > 0:
                counter.inc(delta)
        self._last = dict(stats)
        for key, value in gauges.items():
            self._gauges[key].set(value)


def gauges_of(runtime: Any, tree: Any) -> dict[str, float]:
    from radix_ext import DONOR

    status = runtime.agent.status()
    return {"borrowed_blocks": status.borrowed, "lent_blocks": status.lent,
            "donor_tier_tokens": tree.tier_size(DONOR) if tree.donor is not None else 0}
