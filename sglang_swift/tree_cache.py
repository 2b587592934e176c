"""The `swiftcache` radix cache backend that SGLang builds when --enable-swiftcache is on.

Placeholder until radix_ext is wired in: builds SGLang's own default tree, so the flag is
behaviour-neutral. Owned by the radix_ext work (issue 3), which replaces this body.
"""

from __future__ import annotations

from typing import Any


def create_swift_tree_cache(ctx: Any, config: Any) -> Any:
    """Factory registered as radix cache backend `swiftcache`; `ctx` is SGLang's TreeCacheBuildContext."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    return create_unified_radix_cache(ctx)
