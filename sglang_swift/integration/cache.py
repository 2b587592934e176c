"""`SwiftRadixCache`: SGLang 0.5.23's prefix-cache interface in front of a `radix_ext.RadixTree`.

It subclasses SGLang's Python `RadixCache` for the request-level flow it already gets right
(`checkpoint`, which inserts, frees duplicates, re-matches and moves the request's lock) and
replaces every operation on the tree itself (match, insert, evict, lock, sizes, path indices)
with radix_ext. Node handles given to the scheduler are radix_ext nodes.

Tensors cross the boundary here and only here: radix_ext holds `array('q')` slot indices.
With no donor and no host tier (the case while the data plane is not wired in), the tree makes
the same decisions as SGLang's own LRU radix tree: same matches, same cached-token counts.
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

from radix_ext import RadixTree, TreeConfig

logger = logging.getLogger(__name__)


def tensor_to_indices(t: torch.Tensor) -> array:
    """int64 slot indices as an array('q') (one copy through host memory)."""
    out = array("q")
    if t.numel():
        out.frombytes(t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return out


def indices_to_tensor(a: array, device: torch.device) -> torch.Tensor:
    if not len(a):
        return torch.empty((0,), dtype=torch.int64, device=device)
    return torch.frombuffer(a, dtype=torch.int64).to(device, copy=True)


def namespace_of(key: RadixKey) -> Any:
    """The isolation namespace SGLang gives a key (LoRA id, cache salt); None when plain."""
    if key.extra_key is None and key.cache_salt is None:
        return None
    return (key.extra_key, key.cache_salt)


class SwiftRadixCache(RadixCache):
    """SGLang's radix cache interface, radix_ext inside. `tree_config` picks page size and
    policies; the device tier is SGLang's KV pool, lower tiers are attached by the data plane."""

    def __init__(self, params: CacheInitParams, tree_config: TreeConfig):
        if params.is_eagle:
            raise ValueError("SwiftCache's tree does not support EAGLE (bigram keys) yet; "
                             "run without --enable-swiftcache or without speculative decoding")
        self.tree_config = tree_config
        super().__init__(params)  # calls self.reset()

    # ---- lifecycle ----------------------------------------------------------------------------

    def reset(self) -> None:
        self.tree = RadixTree(self.tree_config)
        self.root_node = self.tree.root
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves = set()  # unused: radix_ext keeps its own leaf set
        self._empty_device_indices = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._empty_match_result = MatchResult(
            device_prefix_len=0,
            last_device_node=self.root_node,
            last_host_node=self.root_node,
            best_match_node=self.root_node,
        )
        self.kv_events.record_all_cleared()

    # ---- tree operations ----------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if self.disable or len(key) == 0:
            return self._empty_match_result
        m = self.tree.match(key.raw_token_ids(), namespace_of(key))
        if m.prefix_len == 0:
            return self._empty_match_result
        # Lower-tier hits (m.loads) are not offered to the scheduler until the data plane can
        # load them back; the device part is what SGLang's own tree would return.
        node = m.last_device_node
        return MatchResult(device_prefix_len=m.device_len, last_device_node=node,
                           last_host_node=node, best_match_node=node)

    def touch_prefix(self, key: RadixKey) -> None:
        if not self.disable and len(key):
            self.tree.match(key.raw_token_ids(), namespace_of(key))

    def insert(self, params: InsertParams) -> InsertResult:
        if self.disable:
            return InsertResult(prefix_len=0)
        key = params.key
        tokens = key.raw_token_ids()
        n = len(tokens) - len(tokens) % self.page_size
        if params.value is None:  # debug/test path, as in SGLang: the tokens stand in for slots
            slots = array("q", tokens[:n])
        else:
            slots = tensor_to_indices(params.value[:n])
        r = self.tree.insert(tokens[:n], slots, namespace_of(key))
        # SGLang's caller frees its slots in [cache_protected_len, prefix_len): the duplicates.
        return InsertResult(prefix_len=r.duplicate_len, last_device_node=r.last_node)

    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()
        plan = self.tree.evict_device(params.num_tokens)
        if plan.copies:
            raise RuntimeError("radix_ext planned lower-tier copies but no data plane is attached")
        allocator = self.token_to_kv_pool_allocator
        for rel in plan.released:
            if rel.tier == "device":
                allocator.free_segment(indices_to_tensor(rel.residency.indices, self.device),
                                       start_pos=0)
        self.update_eviction_metrics(plan.num_evicted, start)
        return EvictResult(num_tokens_evicted=plan.num_evicted)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        before = self.tree.evictable_size()
        self.tree.lock(node)
        return IncLockRefResult(delta=self.tree.evictable_size() - before)

    def dec_lock_ref(self, node: Any, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
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
        return self.tree.protected_size()

    def total_size(self) -> int:
        return self.tree.device_size()

    def all_values_flatten(self) -> torch.Tensor:
        out = array("q")
        stack = list(self.root_node.children.values())
        while stack:
            x = stack.pop()
            res = x.res.get("device")
            if res is not None:
                out.extend(res.indices)
                stack.extend(x.children.values())
        return indices_to_tensor(out, self.device)

    def pretty_print(self) -> None:
        stack = [(self.root_node, 0)]
        while stack:
            x, depth = stack.pop()
            print(" " * depth, len(x.key), list(x.key[:10]), sorted(x.res), f"r={x.lock_ref}")
            stack.extend((c, depth + 2) for c in x.children.values())
        print(f"#tokens: {self.total_size()}")

    def check_integrity(self) -> None:
        self.tree.check_integrity()
