"""The donor lends pages of its own SGLang KV pool and gets them back only after the agent
returns them; its allocator and SGLang's accounting stay exact. Real SGLang allocators on CPU."""

from __future__ import annotations

import pytest
import torch

from sglang_swift.integration.lending import PoolLender


class FakeAgent:
    def __init__(self):
        self.offered: list[int] = []
        self.demands: list[int] = []

    def offer(self, pages):
        self.offered.extend(pages)

    def demand(self, n):
        self.demands.append(n)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _allocator(page_size: int, size: int = 64):
    if page_size == 1:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        return TokenToKVPoolAllocator(size, torch.float32, "cpu", None, need_sort=False)
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(size, page_size, torch.float32, "cpu", None,
                                       need_sort=False)


@pytest.mark.parametrize("page_size", [1, 4])
def test_lent_pages_leave_the_allocator_and_come_back_only_when_returned(page_size):
    """Lending takes pages out of SGLang's allocator (its available size drops), never below
    the reserve; a reclaim frees them into the allocator only on BlocksReturned."""
    alloc, agent, clock = _allocator(page_size), FakeAgent(), Clock()
    lender = PoolLender(alloc, page_size, lend_fraction=0.5, reclaim_watermark=0.75, agent=agent,
                        clock=clock)
    lender.step(evictable_tokens=0, borrowers_present=False)
    assert agent.offered == [] and alloc.available_size() == 64  # nobody to lend to
    lender.step(evictable_tokens=0, borrowers_present=True)
    assert len(agent.offered) * page_size == 32 == lender.lent_tokens  # lend_fraction caps it
    assert alloc.available_size() == 32 and lender.usable_tokens() == 32
    # SGLang's idle invariant with lent pages reported as protected
    assert alloc.available_size() + 0 + lender.lent_tokens == alloc.size
    # the donor's own traffic takes 20 tokens: free 12 < reserve 16 -> every lent page back
    own = alloc.alloc(20)
    assert own is not None
    lender.step(evictable_tokens=8, borrowers_present=True)  # cached prefixes count as room
    assert agent.demands == []
    lender.step(evictable_tokens=0, borrowers_present=True)
    assert sum(agent.demands) * page_size == 32
    assert alloc.available_size() == 12  # nothing freed before the agent returns pages
    lender.step(evictable_tokens=0, borrowers_present=True)
    assert sum(agent.demands) * page_size == 32  # no second demand while one is outstanding
    clock.t = 0.25
    lender.on_returned(agent.offered[:3])
    assert lender.lent_tokens == 32 - 3 * page_size and lender.reclaim_latencies == []
    clock.t = 0.5
    lender.on_returned(agent.offered[3:])
    assert alloc.available_size() == 44 and lender.lent_tokens == 0
    assert lender.usable_tokens() == 64 and lender.reclaim_latencies == [0.5]
    lender.check_integrity()


def test_a_little_own_traffic_right_after_lending_does_not_reclaim():
    """Lending stops a headroom above the reserve: one own token (SGLang's /health probe) must
    not make a donor that may lend down to its reserve take everything back."""
    alloc, agent, clock = _allocator(1), FakeAgent(), Clock()
    lender = PoolLender(alloc, 1, lend_fraction=0.5, reclaim_watermark=0.5, agent=agent,
                        clock=clock)
    lender.step(0, True)
    assert 0 < lender.lent_tokens < 32
    assert alloc.alloc(1) is not None
    lender.step(0, True)
    assert agent.demands == []


def test_no_relend_during_cooldown_and_unknown_returns_are_ignored():
    """After a reclaim the lender waits before lending again; pages it never lent are not freed."""
    alloc, agent, clock = _allocator(1), FakeAgent(), Clock()
    lender = PoolLender(alloc, 1, lend_fraction=0.25, reclaim_watermark=0.5, agent=agent,
                        clock=clock, relend_cooldown_s=10)
    lender.step(0, True)
    assert lender.lent_tokens == 16
    own = alloc.alloc(30)  # free 18 < reserve 32
    lender.step(0, True)
    lender.on_returned(list(agent.offered))
    assert lender.lent_tokens == 0
    alloc.free(own)
    lender.step(0, True)
    assert lender.lent_tokens == 0  # cooling down
    clock.t = 11
    lender.step(0, True)
    assert lender.lent_tokens == 16
    before = alloc.available_size()
    lender.on_returned([10_000])
    assert alloc.available_size() == before


class OwnCache:
    """The donor's own cached prefixes: slots held until `make_room` evicts them (LRU order)."""

    def __init__(self, alloc, n: int):
        self.alloc = alloc
        self.slots = alloc.alloc(n)
        self.asked: list[int] = []

    @property
    def evictable(self) -> int:
        return len(self.slots)

    def make_room(self, n: int) -> int:
        self.asked.append(n)
        n = min(n, len(self.slots))
        self.alloc.free(self.slots[:n])
        self.slots = self.slots[n:]
        return n


def test_an_idle_donor_lends_its_cached_prefixes_after_a_burst_filled_its_pool():
    """A burst leaves the donor's pool full of its own cached prefixes: free pages alone would
    never reach the lend target again. Once it has had no own requests for
    `lend_cached_after_s`, it evicts cached prefixes to lend up to its fraction, keeping the
    reserve and headroom free; not while own requests are queued, and never with 0."""
    alloc, agent, clock = _allocator(1), FakeAgent(), Clock()
    cache = OwnCache(alloc, 48)  # free 16 = reserve 16: nothing to lend from free pages
    lender = PoolLender(alloc, 1, lend_fraction=0.5, reclaim_watermark=0.75, agent=agent,
                        clock=clock, lend_cached_after_s=5, make_room=cache.make_room)
    lender.step(cache.evictable, True, own_demand_tokens=3)  # own request in flight
    assert lender.lent_tokens == 0 and cache.asked == []
    clock.t = 4
    lender.step(cache.evictable, True)
    assert lender.lent_tokens == 0  # idle for 4 s only
    clock.t = 5
    lender.step(cache.evictable, True)
    # room = free 16 + cached 48 - reserve 16 - headroom 4 = 44, capped at 32 lent
    # evicts 36 so that reserve 16 + headroom 4 stay free after lending 32
    assert lender.lent_tokens == 32 and cache.asked == [36]
    assert alloc.available_size() == 20 and cache.evictable == 12
    assert lender.stats["cache_evicted_to_lend_tokens"] == 36
    assert alloc.available_size() + cache.evictable + lender.lent_tokens == alloc.size
    lender.step(cache.evictable, True)
    assert agent.demands == []  # free + cached stays above the reserve: no reclaim

    alloc2, agent2 = _allocator(1), FakeAgent()
    cache2 = OwnCache(alloc2, 48)
    off = PoolLender(alloc2, 1, lend_fraction=0.5, reclaim_watermark=0.75, agent=agent2,
                     clock=clock, lend_cached_after_s=0, make_room=cache2.make_room)
    clock.t = 100
    off.step(cache2.evictable, True)
    assert off.lent_tokens == 0 and cache2.asked == []


def test_refusals_name_the_model_type():
    """A pool the data plane cannot share is refused at start-up naming the model type."""
    from types import SimpleNamespace as NS

    from sglang_swift.integration.backend import model_kind

    ctx = NS(model_config=NS(hf_config=NS(model_type="deepseek_v3",
                                          architectures=["DeepseekV3ForCausalLM"])))
    assert model_kind(ctx) == "model type 'deepseek_v3' (DeepseekV3ForCausalLM)"
    assert model_kind(NS()) == "model type 'unknown' (unknown architecture)"


def test_queued_own_demand_reclaims_in_the_step_it_arrives():
    """A burst queued in the donor's scheduler makes the lender demand every lent page in that
    same step, while its free room is still above the reserve (before: only once admitted
    requests had eaten into the reserve)."""
    alloc, agent, clock = _allocator(1), FakeAgent(), Clock()
    lender = PoolLender(alloc, 1, lend_fraction=0.5, reclaim_watermark=0.75, agent=agent,
                        clock=clock)
    lender.step(0, True)
    assert lender.lent_tokens == 32 and alloc.available_size() == 32  # reserve 16
    lender.step(0, True, own_demand_tokens=0)
    assert agent.demands == []
    lender.step(evictable_tokens=4, borrowers_present=True, own_demand_tokens=20)
    assert agent.demands == []  # 32 + 4 - 20 is the reserve: still enough
    lender.step(evictable_tokens=4, borrowers_present=True, own_demand_tokens=24)
    assert agent.demands == [32] and alloc.available_size() == 32  # 32 + 4 - 24 < 16
    assert lender.reclaim_started == 0.0


def test_lending_leaves_room_for_the_queued_own_demand():
    """Pages the donor's queued requests will need are not lent (lending them would only
    reclaim them at the next step)."""
    alloc, agent, clock = _allocator(1), FakeAgent(), Clock()
    lender = PoolLender(alloc, 1, lend_fraction=0.5, reclaim_watermark=0.75, agent=agent,
                        clock=clock)
    lender.step(0, True, own_demand_tokens=40)  # 64 - 40 - reserve 16 - headroom 4
    assert lender.lent_tokens == 4
    lender.step(0, True, own_demand_tokens=40)
    assert agent.demands == [] and lender.lent_tokens == 4


def test_own_demand_counts_queued_and_running_requests_as_sglang_admission_does():
    """Waiting: sequence so far + output budget left; running: output budget left x the
    scheduler's new-token ratio (1 with ignore_eos); budgets clipped as SGLang clips them."""
    from types import SimpleNamespace as NS

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_swift.integration.lending import own_demand_tokens

    def req(n_in, max_new, n_out=0, ignore_eos=False):
        r = Req(f"r{n_in}", "", list(range(n_in)),
                SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos))
        r.output_ids.extend(range(n_out))
        return r

    waiting = [req(100, 8), req(50, 20, n_out=10), req(7, 10**6)]  # a retracted one; a clipped
    running = [req(30, 100, n_out=40), req(5, 10, n_out=2, ignore_eos=True)]
    scheduler = NS(waiting_queue=waiting, running_batch=NS(reqs=running),
                   new_token_ratio_tracker=NS(current=0.5))
    expect = (100 + 8) + (60 + 10) + (7 + CLIP_MAX_NEW_TOKENS) + 60 * 0.5 + 8
    assert own_demand_tokens(scheduler) == int(expect)
    assert own_demand_tokens(None) == 0
    idle = NS(waiting_queue=[], running_batch=NS(reqs=[]), new_token_ratio_tracker=None)
    assert own_demand_tokens(idle) == 0


def test_step_says_when_own_requests_need_lent_pages():
    """`step` returns True exactly while pages are demanded and the donor's own requests need
    more than its free and evictable room (the caller then waits briefly for them); False when
    the demand is only to restore the reserve or nothing is out."""
    alloc, agent, clock = _allocator(1), FakeAgent(), Clock()
    lender = PoolLender(alloc, 1, lend_fraction=0.5, reclaim_watermark=0.75, agent=agent,
                        clock=clock)
    assert lender.step(0, True) is False and lender.lent_tokens == 32  # 32 free, reserve 16
    assert lender.step(0, True, own_demand_tokens=20) is False  # reserve short, fits in free
    assert agent.demands == [32]
    assert lender.step(0, True, own_demand_tokens=40) is True  # 40 > 32 free: needs lent pages
    lender.on_returned(list(lender.lent))
    assert lender.step(0, True, own_demand_tokens=40) is False  # all back: nothing to wait for
