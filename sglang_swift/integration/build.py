"""How a `SwiftRadixCache` is put together: the one construction path (`build_cache`), used by
the `swiftcache` backend (`backend.py`) and the tests.

Each collaborator is built once, before the cache, from what the server has; a capability it
lacks is a null object (`NoDonorHits`, `NoStorageHits`, `NoRuntime`, `NoMetrics`). Callbacks go
in as constructor arguments: the runtime gets L3's writes and spills, and starts with the
cache's eviction once the cache exists (`SwiftRuntime.start(make_room=)`).
"""

from __future__ import annotations

from typing import Any, Optional

from .cache import LOCAL_STATS, STREAM_STATS, SwiftRadixCache
from .cache_tree import CacheTree
from .donor_hits import DonorHits, NoDonorHits
from .metrics import NoMetrics
from .runtime import NoRuntime
from .storage_hits import NoStorageHits, StorageHits


def build_cache(params: Any, tree_config: Any, config: Any = None, *, model: str = "",
                agent_id: Optional[str] = None, enable_metrics: bool = False,
                tp_worker: Any = None, host_kv: Any = None, storage: Any = None, tp: Any = None,
                runtime: Any = None) -> SwiftRadixCache:
    """A `SwiftRadixCache` over SGLang's `params` (`CacheInitParams`), its tree of
    `tree_config`. `config` (a `SwiftConfig`) starts a `SwiftRuntime` when the server lends or
    borrows (`model`, `agent_id`, `enable_metrics` and, with --tp > 1, `tp`, a
    `tp_sync.TpGroup`, describe it then); a caller may pass a `runtime` of its own instead,
    started by the caller. A tree with a donor or host tier registers its layer counter with
    the KV pool and `tp_worker`. `host_kv` (`host_tier.HostKV`) is the host tier's memory, of
    at least `tree_config.host_capacity` tokens; `storage` (`storage_tier.StorageTier`, with
    `host_kv` only) is L3 below it."""
    if bool(tree_config.host_capacity) != (host_kv is not None) or (
            host_kv is not None and tree_config.host_capacity > host_kv.capacity):
        raise ValueError("the tree's host tier needs host memory of its size: pass host_kv "
                         "(host_tier.HostKV) and host_capacity <= host_kv.capacity, or "
                         "neither")
    if storage is not None and host_kv is None:
        raise ValueError("L3 storage sits below the host tier: pass host_kv with storage")
    allocator = params.token_to_kv_pool_allocator
    seat = CacheTree(tree_config, allocator)
    own_runtime = runtime is None and config is not None and config.uses_donation
    stats: dict = {} if runtime is None else runtime.stats
    storage_hits = (StorageHits(seat, storage, host_kv, stats) if storage is not None
                    else NoStorageHits())
    lower_tiers = tree_config.donor or host_kv is not None
    kv_pool = allocator.get_kvcache() if own_runtime or lower_tiers else None
    if own_runtime:
        runtime = _swift_runtime(config, seat, kv_pool, allocator, stats, storage_hits,
                                 host_kv=host_kv, model=model, agent_id=agent_id, tp=tp)
        stats.update({k: 0 for k in STREAM_STATS})
    elif runtime is None:  # no control channel: the tree counts its own loads and stores
        if host_kv is not None:
            stats.update({k: 0 for k in (*LOCAL_STATS, *STREAM_STATS)})
        runtime = NoRuntime(stats)
    if lower_tiers:
        donor_hits = DonorHits(seat, runtime, stats, kv_pool=kv_pool, tp_worker=tp_worker,
                               storage=storage_hits, host_kv=host_kv)
    else:
        donor_hits = NoDonorHits(seat)
    metrics = NoMetrics()
    if enable_metrics:  # SGLang's --enable-metrics: our series join its /metrics
        from .metrics import SwiftMetrics

        if own_runtime:
            agent, role = runtime.agent_id, config.role
        else:
            agent, role = agent_id or model or "server", "host" if host_kv is not None else "none"
        metrics = SwiftMetrics({"agent": agent, "role": role})
    cache = SwiftRadixCache(params, seat, donor_hits=donor_hits, storage_hits=storage_hits,
                            control=runtime, metrics=metrics, stats=stats)
    if own_runtime:
        runtime.start(make_room=cache.evict_tokens)
    return cache


def _swift_runtime(config: Any, seat: CacheTree, kv_pool: Any, allocator: Any, stats: dict,
                   storage_hits: Any, *, host_kv: Any, model: str, agent_id: Optional[str],
                   tp: Any) -> Any:
    """The runtime of a server that lends or borrows. A borrower with a host tier moves a
    reclaimed donor page into host memory (`ReclaimStaging`); with L3 below, what a reclaim
    moved into host goes on to L3, and what found no room there too (`StorageHits.spill`,
    through the host pool's spill slots)."""
    from .runtime import SwiftRuntime

    staging = spill = None
    if host_kv is not None and config.borrows:
        from ..dataplane.reclaim_staging import ReclaimStaging

        staging = ReclaimStaging(host_kv.write_rows)
        if host_kv.spill_slots is not None:  # reserved only with L3 below
            spill = storage_hits.spill
    return SwiftRuntime(config, model=model, kv_pool=kv_pool, allocator=allocator,
                        tree=seat.tree, page_size=seat.page_size, agent_id=agent_id, tp=tp,
                        stats=stats, on_rescued=storage_hits.write_nodes, staging=staging,
                        spill=spill)
