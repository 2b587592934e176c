"""The `swiftcache` radix cache backend that SGLang builds when --enable-swiftcache is on.

`create_swift_tree_cache` puts radix_ext behind SGLang's prefix-cache interface
(`tree_cache_adapter.SwiftRadixCache`). Tree configuration comes from `SwiftConfig`; model kinds
and options the tree does not handle yet fail here, at start-up, with the fix.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def uses_donation(config: Any) -> bool:
    """Whether this server lends or borrows donated memory (then it runs a SwiftRuntime)."""
    role = getattr(config, "role", "auto")
    lends = role in ("donor", "both", "auto") and getattr(config, "lend_fraction", 0) > 0
    borrows = role in ("borrower", "both", "auto") and getattr(config, "max_borrow_blocks", 0) > 0
    return lends or borrows


def tree_config_for(config: Any, page_size: int):
    """The radix_ext `TreeConfig` for a SwiftConfig (read defensively: fields may be missing).

    The donor tier exists when this server borrows (the data plane copies into it); the host
    tier stays off until a host data path exists: a tier the tree could demote to but nobody
    copies into would hand out KV that is not there.
    """
    from radix_ext import TreeConfig

    policy = getattr(config, "eviction_policy", "lru") or "lru"
    block_tokens = getattr(config, "block_tokens", 0) or 0
    if block_tokens and block_tokens != page_size:
        raise ValueError(f"--swiftcache-block-tokens {block_tokens} must equal --page-size "
                         f"{page_size} (one donated block holds one page); or leave it at 0")
    borrows = (getattr(config, "role", "auto") in ("borrower", "both", "auto")
               and (getattr(config, "max_borrow_blocks", 0) or 0) > 0)
    if getattr(config, "host_tier_tokens", 0):
        logger.warning("SwiftCache: --swiftcache-host-tier-tokens is not wired to a host data "
                       "path yet; running without a host tier")
    return TreeConfig(page_size=page_size, eviction=policy, donor=borrows,
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
    tree_config = tree_config_for(config, params.page_size)
    if uses_donation(config):
        from .donation_cache import DonationRadixCache

        server_args = ctx.server_args
        model = getattr(server_args, "served_model_name", None) or server_args.model_path
        agent_id = f"{str(model).rstrip('/').rsplit('/', 1)[-1]}-{server_args.port}"
        cache = DonationRadixCache(params, tree_config, config, model=str(model),
                                   agent_id=agent_id,
                                   enable_metrics=bool(getattr(server_args, "enable_metrics", False)))
    else:
        from .tree_cache_adapter import SwiftRadixCache

        cache = SwiftRadixCache(params, tree_config)
    logger.info("SwiftCache: radix_ext tree (page_size=%d, eviction=%s)", params.page_size,
                cache.tree_config.eviction)
    return cache
