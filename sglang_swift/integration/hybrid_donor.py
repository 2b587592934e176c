"""A donor serving a hybrid-attention model: SGLang's own tree for the model, and idle pages of
its full-attention KV pool lent.

SGLang 0.5.23 serves hybrid models with two kinds of memory beside each other:
- sliding window (`SWAKVPool`): a full-attention MHA pool and a window pool, with a free list
  for each (`SWATokenToKVPoolAllocator`'s `full_attn_allocator` and `swa_attn_allocator`; a
  token's window slot is found through `full_to_swa_index_mapping`);
- linear attention / SSM (`HybridLinearKVPool`): a full-attention MHA pool (`full_kv_pool`)
  behind the usual token allocator, beside each request's recurrent state in the request pool.
Its `UnifiedRadixCache` keeps, per node, what each of them may reuse (window rows released
outside the window, recurrent state only at checkpoints). SwiftCache's own tree extends
`RadixCache` and tracks one pool, so a hybrid server that borrows or keeps a host tier is
refused (`refusals`). A server that only lends needs no other tree: lending is memory the donor
can take back at once, not layout. It keeps SGLang's `UnifiedRadixCache` (subclassed here:
`LendingUnifiedRadixCache`, built by SGLang's own `create_unified_radix_cache`) and lends pages
of the full-attention pool through that pool's free list:
- a lent page is allocated from the full-attention free list only (`lending_parts`): it has no
  window slot and no recurrent state, and comes back into the same list;
- SGLang's accounting stays exact: the cache reports lent tokens in `full_protected_size()`
  (and `protected_size()`), so the idle check `available + evictable + protected == total`
  holds for the full-attention pool; the window pool and the state pool are never touched;
- the lender (`lending.PoolLender`) and the control channel (`runtime.SwiftRuntime`) are the
  ones every donor runs, stepped once per scheduler loop as every SwiftCache server steps them
  (`swift_step`, `runtime.ControlStep`), with the cache's full-attention evictable part as the
  room it may evict to lend (`lend_cached_after_s`).
The full-attention pool is placed in shared memory by the MHA pool hook
(`shared_kv_pool.py`); so is the window pool, which that hook cannot tell apart and which is
never lent.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from .runtime import ControlStep

logger = logging.getLogger(__name__)


def is_hybrid(ctx: Any) -> bool:
    """Whether SGLang builds the server's pools as a hybrid sliding-window or linear model."""
    return bool(getattr(ctx, "is_hybrid_swa", False) or getattr(ctx, "is_hybrid_ssm", False))


def refusals(ctx: Any, config: Any) -> list[str]:
    """What a hybrid server with SwiftCache cannot do, each with the reason; empty for a server
    that only lends (or neither lends nor borrows: SGLang's own tree, untouched)."""
    kind = "sliding-window" if getattr(ctx, "is_hybrid_swa", False) else "linear-attention"
    out = []
    if config.borrows:
        out.append(f"borrowing for a hybrid {kind} model (SGLang's UnifiedRadixCache keeps its "
                   f"window rows or recurrent state beside the full-attention KV; SwiftCache's "
                   f"tree tracks one KV pool, so its donor tier is not a component of that tree)")
    if config.host_tier:
        out.append(f"a host tier (--enable-hierarchical-cache) for a hybrid {kind} model with "
                   f"SwiftCache (its host tier copies one KV pool; run without --enable-"
                   f"swiftcache for SGLang's own hybrid HiCache)")
    if config.streams_layers:
        out.append(f"the layer stream cache for a hybrid {kind} model (it streams one MHA "
                   f"pool's K and V rows)")
    if (getattr(ctx, "tp_size", 1) or 1) > 1 and config.lends:
        out.append(f"lending from a hybrid {kind} model with --tp {ctx.tp_size} (a TP donor's "
                   f"ranks agree on page ids through SwiftCache's tree, which this server does "
                   f"not use)")
    if getattr(ctx, "is_hybrid_swa", False) and not getattr(ctx, "full_tokens_per_layer", 1):
        out.append("lending from a model whose every layer is sliding-window (it has no "
                   "full-attention pool to lend)")
    return out


def lending_parts(allocator: Any) -> tuple[Any, Any]:
    """(free list, KV pool) a hybrid donor lends from: the full-attention allocator and pool
    behind SGLang's hybrid allocator. Raises UnshareablePool naming the pool it cannot lend
    from."""
    from ..dataplane import UnshareablePool

    pool = allocator.get_kvcache()
    full_pool = getattr(pool, "full_kv_pool", None)
    if full_pool is None:
        raise UnshareablePool(f"{type(pool).__name__} has no full-attention pool "
                              f"(full_kv_pool)")
    if hasattr(allocator, "full_attn_allocator"):  # sliding window: one free list per pool
        if getattr(allocator, "swa_req_ring", False):
            raise UnshareablePool(f"{type(allocator).__name__} keeps window rows in "
                                  f"per-request rings")
        free_list = allocator.full_attn_allocator
        if free_list.get_kvcache() is not full_pool:
            raise UnshareablePool(f"{type(allocator).__name__}'s full-attention free list "
                                  f"does not serve {type(pool).__name__}'s full-attention pool")
        return free_list, full_pool
    # linear attention: the token allocator's slots are the full-attention pool's (the hybrid
    # pool maps only layer ids onto it)
    return allocator, full_pool


class LendingUnifiedRadixCache(UnifiedRadixCache):
    """SGLang's `UnifiedRadixCache`, as SGLang builds it for the model, on a server that lends
    pages of its full-attention pool. `attach(runtime, metrics)` once built; until then (and
    with a runtime that lends nothing) it is SGLang's cache exactly."""

    runtime: Any = None
    metrics: Any = None

    def attach(self, runtime: Any, metrics: Any) -> None:
        self.runtime, self.metrics = runtime, metrics
        self._control_step = ControlStep()

    def full_protected_size(self) -> int:
        """Locked full-attention tokens plus the pages lent out of that pool: neither free nor
        evictable, and in use for SGLang's idle check."""
        return super().full_protected_size() + self._lent()

    def protected_size(self) -> int:
        return super().protected_size() + self._lent()

    def _lent(self) -> int:
        return self.runtime.lent_tokens if self.runtime is not None else 0

    def evict_tokens(self, num_tokens: int) -> int:
        """Evict this many full-attention tokens of the server's own cache (the lender's
        `make_room`): the tokens evicted."""
        return self.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted

    def swift_step(self, scheduler: Any = None) -> None:
        """Once per scheduler loop (the plugin's hook): control events and lending, as every
        SwiftCache server runs them (`runtime.ControlStep`), then /metrics when due."""
        runtime = self.runtime
        if runtime is None:
            return
        now = time.monotonic()
        self._control_step(runtime, scheduler, now)
        if self.metrics.due(now):
            from .metrics import gauges_of

            self.metrics.update(runtime.stats, gauges_of(runtime, None, runtime.allocator.size))
            self.metrics.observe_reclaims(runtime.reclaim_latencies)


def create_lending_hybrid_cache(ctx: Any, config: Any, *, model: str, agent_id: str,
                                enable_metrics: bool) -> Any:
    """The tree cache of a hybrid server started with --enable-swiftcache: SGLang's own
    `UnifiedRadixCache` for the model, lending from its full-attention pool when the server
    lends. Raises UnshareablePool when the pool behind it cannot be lent."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    from .metrics import NoMetrics
    from .runtime import SwiftRuntime

    cache = create_unified_radix_cache(ctx, cache_class=LendingUnifiedRadixCache)
    if not config.lends:
        return cache
    params = ctx.params
    free_list, full_pool = lending_parts(params.token_to_kv_pool_allocator)
    runtime = SwiftRuntime(config, model=model, kv_pool=full_pool, allocator=free_list,
                           tree=None, page_size=params.page_size, agent_id=agent_id)
    metrics = NoMetrics()
    if enable_metrics:
        from .metrics import SwiftMetrics

        metrics = SwiftMetrics({"agent": runtime.agent_id, "role": config.role})
    cache.attach(runtime, metrics)
    runtime.start(make_room=cache.evict_tokens, evictable=cache.full_evictable_size)
    logger.info("SwiftCache: SGLang's UnifiedRadixCache for this hybrid model, lending pages of "
                "its full-attention pool (%d layers, %d tokens)", full_pool.layer_num,
                free_list.size)
    return cache
