"""The `swiftcache` radix cache backend that SGLang builds when --enable-swiftcache is on.

`create_swift_tree_cache` puts radix_ext behind SGLang's prefix-cache interface
(`tree_cache_adapter.SwiftRadixCache`). Tree configuration comes from `SwiftConfig`; model kinds
and options the tree does not handle yet fail here, at start-up, with the fix.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def tree_config_for(config: Any, page_size: int):
    """The radix_ext `TreeConfig` for a SwiftConfig (read defensively: fields may be missing).

    Lower tiers stay off until the data plane attaches them: a tier the tree could demote to
    but nobody copies into would hand out KV that is not there.
    """
    from radix_ext import TreeConfig

    policy = getattr(config, "eviction_policy", "lru") or "lru"
    wants = {
        "donor blocks": getattr(config, "max_borrow_blocks", 0) or 0,
        "host tier tokens": getattr(config, "host_tier_tokens", 0) or 0,
    }
    asked = [f"{k}={v}" for k, v in wants.items() if v]
    if asked:
        logger.warning("SwiftCache: %s configured, but the tree keeps them off until the data "
                       "plane is attached; running device-only", ", ".join(asked))
    return TreeConfig(page_size=page_size, eviction=policy,
                      demotion="cost_aware" if policy == "cost_aware" else "tiered")


def create_swift_tree_cache(ctx: Any, config: Any) -> Any:
    """Factory registered as radix cache backend `swiftcache`; `ctx` is SGLang's TreeCacheBuildContext."""
    unsupported = [name for name, on in (
        ("hybrid sliding-window attention", getattr(ctx, "is_hybrid_swa", False)),
        ("hybrid SSM/mamba layers", getattr(ctx, "is_hybrid_ssm", False)),
        ("DSA attention", getattr(ctx, "is_dsa", False)),
        ("--enable-hierarchical-cache", getattr(ctx, "enable_hierarchical_cache", False)),
    ) if on]
    params = ctx.params
    if (getattr(params, "eviction_policy", "lru") or "lru").lower() != "lru":
        unsupported.append(f"--radix-eviction-policy {params.eviction_policy} (SwiftCache orders "
                           f"evictions itself: use --swiftcache-eviction-policy)")
    if getattr(params, "enable_kv_cache_events", False):
        unsupported.append("KV cache events (not emitted by SwiftCache's tree yet)")
    if unsupported:
        raise ValueError(f"SwiftCache's tree does not support: {'; '.join(unsupported)}. Drop those "
                         f"options or run without --enable-swiftcache (SwiftCache has its own tiers: "
                         f"no --enable-hierarchical-cache needed).")
    from .tree_cache_adapter import SwiftRadixCache

    cache = SwiftRadixCache(params, tree_config_for(config, params.page_size))
    logger.info("SwiftCache: radix_ext tree (page_size=%d, eviction=%s)", params.page_size,
                cache.tree_config.eviction)
    return cache
