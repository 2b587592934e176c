"""In-process parity of the `swiftcache` adapter with SGLang's own Python RadixCache.

Invariant: driven by the same random sequence of insert / match / lock / unlock / evict calls
(with no lower tier), `SwiftRadixCache` returns the same matched lengths and device indices,
reports the same duplicate lengths, evicts the same slots and keeps the same evictable/protected
sizes as SGLang's `RadixCache`. SGLang's LRU clock is made a strictly increasing counter so both
trees see the same order of events (ties in wall-clock time would make either side arbitrary).
"""

from __future__ import annotations

import itertools
import random
from array import array

import pytest

torch = pytest.importorskip("torch")


class RecordingAllocator:
    device = "cpu"

    def __init__(self):
        self.freed: list[int] = []

    def free_segment(self, t, *, start_pos):
        self.freed.extend(t.tolist())


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_adapter_matches_sglang_radix_cache(monkeypatch, seed, page_size):
    from sglang.srt.mem_cache import radix_cache as rc
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from radix_ext import TreeConfig
    from sglang_swift.integration.build import build_cache

    ticks = itertools.count()
    monkeypatch.setattr(rc.time, "monotonic", lambda: float(next(ticks)))
    stock_alloc, swift_alloc = RecordingAllocator(), RecordingAllocator()
    stock = rc.RadixCache.create_simulated(mock_allocator=stock_alloc, page_size=page_size)
    swift = build_cache(
        CacheInitParams(disable=False, req_to_token_pool=None,
                        token_to_kv_pool_allocator=swift_alloc, page_size=page_size),
        TreeConfig(page_size=page_size))
    rng = random.Random(seed)
    next_slot = 0
    locks = []

    def key(tokens, extra=None):
        return rc.RadixKey(array("q", tokens), extra)

    for _ in range(400):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 24))]
        extra = rng.choice([None, None, "lora"])
        op = rng.random()
        if op < 0.35:
            value = torch.arange(next_slot, next_slot + len(tokens), dtype=torch.int64)
            next_slot += len(tokens)
            a = stock.insert(InsertParams(key=key(tokens, extra), value=value))
            b = swift.insert(InsertParams(key=key(tokens, extra), value=value))
            assert a.prefix_len == b.prefix_len
        elif op < 0.7:
            a = stock.match_prefix(MatchPrefixParams(key=key(tokens, extra)))
            b = swift.match_prefix(MatchPrefixParams(key=key(tokens, extra)))
            assert a.device_prefix_len == b.device_prefix_len
            assert torch.equal(stock.path_device_indices(a.last_device_node),
                               swift.path_device_indices(b.last_device_node))
            if op < 0.5:
                locks.append((stock.lock(a.last_device_node), swift.lock(b.last_device_node)))
        elif op < 0.85 and locks:
            la, lb = locks.pop(rng.randrange(len(locks)))
            stock.unlock(la)
            swift.unlock(lb)
        else:
            n = rng.randrange(1, 30)
            a = stock.evict(EvictParams(num_tokens=n))
            b = swift.evict(EvictParams(num_tokens=n))
            assert a.num_tokens_evicted == b.num_tokens_evicted
            assert sorted(stock_alloc.freed) == sorted(swift_alloc.freed)
        assert (stock.evictable_size(), stock.protected_size(), stock.total_size()) == (
            swift.evictable_size(), swift.protected_size(), swift.total_size())
        swift.check_integrity()


def _ctx(**overrides):
    from types import SimpleNamespace

    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=RecordingAllocator(), page_size=1,
                             **overrides.pop("params", {}))
    server_args = SimpleNamespace(model_path="/models/tiny", served_model_name=None, port=30000,
                                  enable_metrics=False)  # what the backend reads of SGLang's
    fields = dict(params=params, is_hybrid_swa=False, is_hybrid_ssm=False, is_dsa=False,
                  enable_hierarchical_cache=False, server_args=server_args, tp_worker=None)
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_factory_builds_radix_ext_with_the_configured_policy():
    from sglang_swift.config import SwiftConfig
    from sglang_swift.integration.backend import create_swift_tree_cache
    from sglang_swift.integration.cache import SwiftRadixCache

    cache = create_swift_tree_cache(_ctx(), SwiftConfig.parse(eviction_policy="cost_aware"))
    assert isinstance(cache, SwiftRadixCache) and cache.tree.eviction.name == "cost_aware"
    assert cache.runtime is None and cache.tree.donor is None, "neither lends nor borrows"
    cache.swift_step()  # the plugin's per-iteration hook is a no-op without a runtime
    assert create_swift_tree_cache(_ctx(), SwiftConfig()).tree.eviction.name == "lru"


@pytest.mark.parametrize("overrides", [
    {"is_dsa": True}, {"enable_hierarchical_cache": True},
    {"params": {"eviction_policy": "lfu"}}, {"params": {"enable_kv_cache_events": True}},
])
def test_factory_refuses_what_the_tree_cannot_do_with_the_fix(overrides):
    from sglang_swift.config import SwiftConfig
    from sglang_swift.integration.backend import create_swift_tree_cache

    with pytest.raises(ValueError, match="run without --enable-swiftcache"):
        create_swift_tree_cache(_ctx(**overrides), SwiftConfig())


def test_hicache_through_the_backend_alone_is_refused_with_the_flag_to_use():
    """--enable-hierarchical-cache reaches SwiftCache's tree as its host tier through
    --enable-swiftcache (the launcher takes HiCache's options and clears SGLang's flag); a
    scheduler that still has SGLang's flag on was started with --radix-cache-backend swiftcache
    alone, and is told to use --enable-swiftcache."""
    from sglang_swift.config import SwiftConfig
    from sglang_swift.integration.backend import create_swift_tree_cache

    with pytest.raises(ValueError) as refused:
        create_swift_tree_cache(_ctx(enable_hierarchical_cache=True), SwiftConfig())
    text = str(refused.value)
    assert "--enable-hierarchical-cache" in text and "--enable-swiftcache" in text
    assert "host tier" in text and "not needed" not in text
