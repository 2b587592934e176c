"""The scheduler-thread time SwiftCache's own code takes, by phase (integration/work_clock.py)."""

from __future__ import annotations

import pytest

from sglang_swift.integration.work_clock import PHASES, WorkClock, timed


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Cache:
    """Stands in for the cache class: an eviction asked for from inside a load-back."""

    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.work = WorkClock(clock)

    @timed("load_back")
    def init_load_back(self) -> str:
        self.clock.now += 1.0
        self.evict()
        self.clock.now += 0.5
        return "loaded"

    @timed("evict")
    def evict(self) -> None:
        self.clock.now += 2.0

    @timed("match")
    def match(self) -> None:
        self.clock.now += 0.25
        raise KeyError("no such prefix")


def test_a_nested_phase_counts_in_itself_and_not_in_its_caller():
    clock = FakeClock()
    cache = Cache(clock)
    assert cache.init_load_back() == "loaded"
    assert cache.work.seconds["load_back"] == pytest.approx(1.5)
    assert cache.work.seconds["evict"] == pytest.approx(2.0)
    assert sum(cache.work.seconds.values()) == pytest.approx(clock.now)


def test_a_phase_that_raises_is_still_counted_and_closed():
    clock = FakeClock()
    cache = Cache(clock)
    with pytest.raises(KeyError):
        cache.match()
    cache.evict()
    assert cache.work.seconds["match"] == pytest.approx(0.25)
    assert cache.work.seconds["evict"] == pytest.approx(2.0)


def test_an_unknown_phase_is_refused_naming_the_phases():
    with pytest.raises(ValueError, match="unknown phase 'forward'.*match"):
        timed("forward")


def test_the_cache_times_what_the_scheduler_calls():
    """SwiftRadixCache without donation: a match, an insert, an eviction and the loop hook each
    land in their phase, and only there."""
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from radix_ext import TreeConfig
    from sglang_swift.integration.build import build_cache

    alloc = TokenToKVPoolAllocator(64, torch.int64, "cpu", None, need_sort=False)
    cache = build_cache(
        CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                        page_size=1), TreeConfig(page_size=1))
    assert all(s == 0.0 for s in cache.work.seconds.values())
    tokens = list(range(1, 33))
    slots = alloc.alloc(len(tokens))
    cache.insert(InsertParams(key=RadixKey(tokens), value=slots))
    after_insert = dict(cache.work.seconds)
    assert after_insert["insert"] > 0 and after_insert["match"] == 0
    cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    assert cache.work.seconds["match"] > 0
    cache.evict(EvictParams(num_tokens=8))
    assert cache.work.seconds["evict"] > 0
    cache.swift_step(None)
    assert cache.work.loops == 1 and cache.work.seconds["loop"] > 0
    assert set(cache.work.seconds) == set(PHASES)
    assert isinstance(slots, torch.Tensor)


def test_a_benchmark_reads_the_work_between_two_scrapes_per_unit():
    from benchmarks.instruments.work import LOOPS, SERIES, breakdown

    before = {SERIES["match"]: 1.0, SERIES["evict"]: 0.5, LOOPS: 10}
    after = {SERIES["match"]: 1.2, SERIES["evict"]: 0.9, SERIES["batch_start"]: 0.1, LOOPS: 60}
    got = breakdown(before, after, 100, "forward step")
    assert got["ms"]["match"] == pytest.approx(2.0) and got["ms"]["evict"] == pytest.approx(4.0)
    assert got["ms"]["batch_start"] == pytest.approx(1.0) and got["ms"]["insert"] == 0
    assert got["total_ms"] == pytest.approx(7.0) and got["loops"] == 50
    assert got["unit"] == "forward step" and got["count"] == 100
    assert breakdown(None, after, 100, "request") is None  # stock: no series
    assert breakdown(before, after, 0, "request") is None
