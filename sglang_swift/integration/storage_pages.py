"""Page I/O between SwiftCache's host tier and an SGLang storage backend, over the backend's
public interface (`HiCacheStorage`) and the host pool's page accessors.

HiCache's controller does the same with its own methods; SwiftCache's tree replaces HiCache's,
so it keeps its own copy of the few rules those methods hold, each listed in the manifest with
its check (`touchpoints.STORAGE_CONFIG`, `STORAGE_PAGE_RULES`, `STORAGE_INTERFACE`):
- the storage config a backend is built with (`storage_config`): this rank's place in the
  parallel layout, the host pool's layout and the model name tagged with the pool's page format;
- a hit query walks the request's page keys in batches of `STORAGE_BATCH_SIZE` and stops at the
  first batch not wholly present; the backend sees the keys before each batch (`prefix_keys`);
- reads and writes are zero-copy (`batch_get_v1` / `batch_set_v1` on host slots) for the
  backends HiCache runs zero-copy, else page by page through flat page tensors.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# the backends HiCache's controller drives zero-copy (and `dynamic` with interface_v1 set)
ZERO_COPY_BACKENDS = ("hf3fs", "mooncake", "npu_memcache", "eic", "nixl", "simm", "mori",
                      "tensorcast", "seaweedfs")


def is_zero_copy(name: str, extra: dict | None) -> bool:
    return name in ZERO_COPY_BACKENDS or (
        name == "dynamic" and bool((extra or {}).get("interface_v1", 0)))


def storage_config(host_kv: Any, model_name: str, extra: dict | None, page_size: int) -> Any:
    """The `HiCacheStorageConfig` for a backend below host memory `host_kv` (a `HostKV`).
    `extra` (the backend's extra config) loses its `tp_lcm_size`, as HiCache's does."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.managers.cache_controller import storage_model_name
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    extra = {} if extra is None else extra
    parallel = get_parallel()
    if is_dp_attention_enabled():
        tp_rank, tp_size, dp_rank = (parallel.attn_tp_rank, parallel.attn_tp_size,
                                     parallel.attn_dp_rank)
    else:
        tp_rank, tp_size, dp_rank = parallel.tp_rank, parallel.tp_size, 0
    replicated = isinstance(host_kv.kv_pool, MLATokenToKVPool)  # every rank holds the same KV
    layout = host_kv.pool.layout
    tp_lcm_size = extra.pop("tp_lcm_size", None)
    if tp_lcm_size and tp_lcm_size % tp_size:
        raise ValueError(f"tp_lcm_size {tp_lcm_size} in --hicache-storage-backend-extra-config "
                         f"must be a multiple of --tp {tp_size}")
    dcp_size = parallel.attn_dcp_size
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=parallel.pp_rank, pp_size=parallel.pp_size,
        attn_cp_rank=0, attn_cp_size=1,  # SwiftCache's tree runs without context parallelism
        is_mla_model=replicated, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first",
        model_name=storage_model_name(model_name, host_kv.pool), tp_lcm_size=tp_lcm_size,
        should_split_heads=bool(tp_lcm_size) and not replicated and layout == "page_head"
        and tp_lcm_size > tp_size,
        dp_rank=dp_rank, extra_config=extra, dcp_size=dcp_size,
        dcp_rank=parallel.attn_dcp_rank if dcp_size > 1 else 0,
        logical_page_size=page_size if dcp_size > 1 else None)


class StoragePages:
    """Queries, reads and writes of whole pages between host pool `host_pool` and storage
    backend `backend`; `zero_copy` picks the backend's v1 calls on host slots."""

    def __init__(self, backend: Any, host_pool: Any, page_size: int, zero_copy: bool):
        self.backend = backend
        self.host_pool = host_pool
        self.page_size = page_size
        self.zero_copy = zero_copy

    def hit_query(self, op: Any) -> tuple[list, int]:
        """(page keys present, tokens present) for prefetch `op` (SGLang's `PrefetchOperation`:
        its tokens continue the prefix whose last page key is `op.last_hash`): the leading
        pages found, in batches of STORAGE_BATCH_SIZE."""
        from sglang.srt.mem_cache.hicache_storage import (
            STORAGE_BATCH_SIZE,
            HiCacheStorageExtraInfo,
        )
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        keys = get_storage_hash_str(op.token_ids, op.last_hash, page_size=self.page_size)
        op.all_hash_values = keys
        prefix_keys = op.prefix_keys
        found: list = []
        for start in range(0, len(keys), STORAGE_BATCH_SIZE):
            batch = keys[start:start + STORAGE_BATCH_SIZE]
            n = self.backend.batch_exists(batch, HiCacheStorageExtraInfo(prefix_keys=prefix_keys))
            found.extend(batch[:n])
            if n < len(batch):
                break
            if prefix_keys is not None:
                prefix_keys = prefix_keys + batch
        return found, len(found) * self.page_size

    def get(self, op: Any, keys: list, host_slots: Any) -> int:
        """Read pages `keys` into `host_slots` (page by page); returns the leading pages read.
        Stops early when `op` is terminated (page by page reads only, as HiCache's)."""
        if self.zero_copy:
            ok = self.backend.batch_get_v1(keys, host_slots, None)
            return next((i for i, good in enumerate(ok) if not good), len(keys))
        dummies = [self.host_pool.get_dummy_flat_data_page() for _ in keys]
        pages = self.backend.batch_get(keys, dummies)
        if pages is None:
            return 0
        count = 0
        for i, page in enumerate(pages):
            if page is None or op.is_terminated():
                break
            self.host_pool.set_from_flat_data_page(host_slots[i * self.page_size], page)
            count += 1
        return count

    def set(self, keys: list, host_slots: Any) -> bool:
        """Write the pages at `host_slots` under `keys`; whether every page was written."""
        if self.zero_copy:
            return all(self.backend.batch_set_v1(keys, host_slots, None))
        data = [self.host_pool.get_data_page(host_slots[i * self.page_size])
                for i in range(len(keys))]
        return self.backend.batch_set(keys, data)
