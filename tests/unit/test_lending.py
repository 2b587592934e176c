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


def test_refusals_name_the_model_type():
    """A pool the data plane cannot share is refused at start-up naming the model type."""
    from types import SimpleNamespace as NS

    from sglang_swift.integration.backend import model_kind

    ctx = NS(model_config=NS(hf_config=NS(model_type="deepseek_v3",
                                          architectures=["DeepseekV3ForCausalLM"])))
    assert model_kind(ctx) == "model type 'deepseek_v3' (DeepseekV3ForCausalLM)"
    assert model_kind(NS()) == "model type 'unknown' (unknown architecture)"
