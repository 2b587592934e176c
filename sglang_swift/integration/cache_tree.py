"""The radix_ext tree behind `SwiftRadixCache` and SGLang's device slots it indexes.

`CacheTree` is shared by the cache and its collaborators (donor hits, storage hits, demotions,
streamed loads): each reads `tree` at every use, since `reset` (SGLang's flush) replaces it.
Tensors cross the boundary between SGLang and radix_ext here: the tree keeps SGLang's device
tensors of slot indices as opaque handles, and holds `array('q')` indices for everything else.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import DecLockRefParams, TreeLock

from radix_ext import DevicePool, RadixTree, TreeConfig, slot_runs

from ..dataplane.pool_rows import to_device


def indices_to_tensor(a: Any, device: torch.device) -> torch.Tensor:
    """Slot indices as an int64 tensor on `device`: a tensor (SGLang's, as the tree holds it)
    as it is; host indices (`array('q')`: the debug insert, the tests) through one asynchronous
    copy (pinned on a GPU)."""
    if isinstance(a, torch.Tensor):
        return a
    if not len(a):
        return torch.empty((0,), dtype=torch.int64, device=device)
    return to_device(torch.frombuffer(a, dtype=torch.int64).clone(), device)


def namespace_of(key: Any) -> Any:
    """The isolation namespace SGLang gives a key (LoRA id, cache salt); None when plain."""
    if key.extra_key is None and key.cache_salt is None:
        return None
    return (key.extra_key, key.cache_salt)


def device_of(allocator: Any) -> torch.device:
    """The device of SGLang's slot allocator, as SGLang's RadixCache reads it."""
    dev = getattr(allocator, "device", None)
    return torch.device(dev) if isinstance(dev, (str, torch.device)) else torch.device("cpu")


class KVSlots(DevicePool):
    """SGLang's KV slot allocator as radix_ext's admission sees it. Slots go back with
    `free_segment` (page-aligned runs, as SGLang's own eviction frees them). Room is made by
    radix_ext's eviction (`DevicePool.make_room`: no lower tier, nothing copied); a cache with
    lower tiers demotes instead (`donor_hits.DemotingSlots`)."""

    def __init__(self, allocator: Any, device: torch.device):
        self.allocator = allocator
        self.device = device

    def available(self) -> int:
        return self.allocator.available_size()

    def alloc(self, num_tokens: int) -> Optional[torch.Tensor]:
        return self.allocator.alloc(num_tokens)  # a device tensor, kept as the tree's handle

    def free(self, indices: Any) -> None:
        if len(indices):
            self.allocator.free_segment(indices_to_tensor(indices, self.device), start_pos=0)


class CacheTree:
    """The cache's current `tree` (a `RadixTree` of `config`) and its device `slots`."""

    def __init__(self, config: TreeConfig, allocator: Any):
        slot_runs.register(torch.Tensor, torch.cat)  # the tree joins SGLang's slot tensors
        self.config = config
        self.page_size = config.page_size
        self.device = device_of(allocator)
        self.slots = KVSlots(allocator, self.device)
        self.tree = RadixTree(config)

    def reset(self) -> RadixTree:
        """Replace the tree with an empty one (SGLang's flush); returns it."""
        self.tree = RadixTree(self.config)
        return self.tree

    def lock_delta(self, node: Any, lock: bool) -> int:
        """Lock (or unlock) the path to `node`; returns the change of the evictable size, as
        SGLang's lock results report it."""
        before = self.tree.evictable_size()
        if lock:
            self.tree.lock(node)
        else:
            self.tree.unlock(node)
        return self.tree.evictable_size() - before

    def lock(self, node: Any) -> TreeLock:
        """A request's tree lock on `node`, as SGLang's `BasePrefixCache.lock` makes one."""
        self.lock_delta(node, True)
        return TreeLock(node, DecLockRefParams())

    def unlock(self, lock: Optional[TreeLock]) -> None:
        """Release a tree lock (SGLang's `BasePrefixCache.unlock`)."""
        if lock is not None:
            self.lock_delta(lock.node, False)
