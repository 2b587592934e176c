"""Hybrid-attention donors against SGLang's own pool classes on CPU: a sliding-window model's
`SWAKVPool` behind `SWATokenToKVPoolAllocator` (a free list per pool) and a linear-attention
model's `HybridLinearKVPool` behind the token allocator (its recurrent state lives in the request
pool, not here). A hybrid donor lends pages of its full-attention pool only, through that pool's
own free list (`hybrid_donor.lending_parts`): the window pool and its free list never change, a
borrower's rows come back bit-identical from the lent pages, and the donor's own traffic takes
every page back into the full-attention free list after the borrower acknowledged. What a hybrid
server cannot do with SwiftCache is refused at start-up naming the attention and the reason.
The live sliding-window donor: `tests/integration/test_model_kinds_e2e.py`; the CPU backend's window
reads: `sglang_swift/cpu_compat/window_reads.py`.
"""

from __future__ import annotations

import pytest
import torch

from radix_ext import DONOR
from sglang_swift.config import CONFIG_ENV
from sglang_swift.dataplane import UnshareablePool
from sglang_swift.dataplane.pool_lease import lending_page
from sglang_swift.integration.hybrid_donor import lending_parts, refusals
from sglang_swift.integration.shared_kv_pool import shared_region_of
from tests.unit.test_models_fp8 import LENDING, mha_pool, write_kv
from tests.unit.test_models_mla import BORROWER_SHAPE, SLOTS, _runtime, store_and_load_back

FULL, WINDOW = [0, 2], [1, 3]  # layer ids: full-attention and sliding-window layers alternate
HEADS, DIM = 2, 8


@pytest.fixture(scope="module", autouse=True)
def lending_hooks():
    from tests.unit.test_runtime import apply_lending_hooks

    apply_lending_hooks()


def swa_donor(monkeypatch):
    """SGLang's SWAKVPool and its allocator, built as a lending server's scheduler builds them."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    monkeypatch.setenv(CONFIG_ENV, LENDING.to_json())
    pool = SWAKVPool(size=SLOTS, size_swa=SLOTS // 2, page_size=1, dtype=torch.float32,
                     head_num=HEADS, head_dim=DIM, swa_attention_layer_ids=WINDOW,
                     full_attention_layer_ids=FULL, device="cpu", enable_memory_saver=False)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    allocator = SWATokenToKVPoolAllocator(SLOTS, SLOTS // 2, 1, torch.float32, "cpu", pool,
                                          need_sort=False)
    return pool, allocator


def linear_donor(monkeypatch):
    """SGLang's HybridLinearKVPool (full-attention layers 0 and 2 of a linear-attention model)
    behind the token allocator, built as a lending server's scheduler builds them. Its mamba
    state pool belongs to the request pool and takes no part in lending (None here)."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    monkeypatch.setenv(CONFIG_ENV, LENDING.to_json())
    pool = HybridLinearKVPool(size=SLOTS, dtype=torch.float32, page_size=1, head_num=HEADS,
                              head_dim=DIM, full_attention_layer_ids=FULL, device="cpu",
                              mamba_pool=None)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    allocator = TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", pool, need_sort=False)
    return pool, allocator


DONORS = {"swa": swa_donor, "linear": linear_donor}


def _window_free(allocator) -> int | None:
    return allocator.swa_available_size() if hasattr(allocator, "swa_available_size") else None


@pytest.mark.parametrize("kind", sorted(DONORS))
def test_a_hybrid_donor_lends_its_full_attention_pages_and_takes_them_back(kind, tmp_path,
                                                                          monkeypatch):
    """Invariant (the reclaim guarantee, a hybrid donor): its lent pages come out of the
    full-attention free list only (a sliding-window pool's window list is never touched), a
    borrower's demoted prefix loads back bit-identical from them, and when the donor's own
    traffic needs them every page returns to that free list only after the borrower
    acknowledged, with the borrower's tree holding no donor block."""
    from tests.unit.test_runtime import _pump_until

    pool, allocator = DONORS[kind](monkeypatch)
    free_list, full_pool = lending_parts(allocator)
    assert full_pool is pool.full_kv_pool
    assert free_list is (allocator.full_attn_allocator if kind == "swa" else allocator)
    assert shared_region_of(full_pool) is not None  # placed by the MHA pool hook
    assert lending_page(full_pool).num_layers == len(FULL)
    write_kv(full_pool, seed=11)
    window_before = _window_free(allocator)
    borrower_pool = mha_pool(torch.float32, monkeypatch, lend=False, size=SLOTS, page=1,
                             **BORROWER_SHAPE)
    write_kv(borrower_pool, seed=12)
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    donor = _runtime(tmp_path, monkeypatch, f"{kind}-donor", full_pool, free_list,
                     role="donor", lend_fraction=0.5)
    borrower = _runtime(tmp_path, monkeypatch, "borrower", borrower_pool,
                        TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", borrower_pool,
                                               need_sort=False),
                        role="borrower", max_borrow_blocks=16)
    donor.start(evictable=lambda: 0)
    borrower.start()
    try:
        _pump_until((donor, borrower), lambda: borrower.tree.donor.capacity_tokens() > 0)
        assert donor.lent_tokens == 32 and free_list.available_size() == 32
        assert _window_free(allocator) == window_before
        tree = borrower.tree
        store_and_load_back(borrower, borrower_pool)
        own = allocator.alloc(free_list.available_size())  # its own burst, through SGLang's
        assert own is not None                             # hybrid allocator
        _pump_until((donor, borrower), lambda: donor.lent_tokens == 0)
        assert borrower.stats["reclaims"] > 0 and tree.tier_size(DONOR) == 0
        assert free_list.available_size() == 32  # every lent page back, after the ack
        tree.check_integrity()
        donor.lender.check_integrity()
    finally:
        borrower.stop()
        donor.stop()
        for p in (pool.full_kv_pool, getattr(pool, "swa_kv_pool", None)):
            shared = shared_region_of(p) if p is not None else None
            if shared is not None:
                shared[0].close()


def test_lending_parts_refuse_a_pool_without_a_full_attention_part(monkeypatch):
    """Invariant: a hybrid donor whose pool has no full-attention pool behind its allocator is
    refused naming the pool, not lent from."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    plain = mha_pool(torch.float32, monkeypatch, lend=False, size=SLOTS, page=1)
    with pytest.raises(UnshareablePool, match="MHATokenToKVPool has no full-attention pool"):
        lending_parts(TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", plain,
                                             need_sort=False))


@pytest.mark.parametrize("flag, kind", [("is_hybrid_swa", "sliding-window"),
                                        ("is_hybrid_ssm", "linear-attention")])
def test_a_hybrid_server_may_lend_and_is_refused_the_rest_naming_its_attention(flag, kind):
    """Invariant: a hybrid server that only lends (or neither lends nor borrows) is accepted;
    borrowing, a host tier, the layer stream cache and TP lending are refused at start-up with
    the reason, the model type and its attention."""
    from types import SimpleNamespace as NS

    from sglang_swift.config import SwiftConfig
    from sglang_swift.integration.backend import create_swift_tree_cache

    ctx = NS(tp_size=1, full_tokens_per_layer=SLOTS, **{flag: True})
    assert refusals(ctx, SwiftConfig(enabled=True, lend_fraction=0.5)) == []
    assert refusals(ctx, SwiftConfig(enabled=True)) == []
    cases = [(dict(max_borrow_blocks=8), f"borrowing for a hybrid {kind} model"),
             (dict(host_tier=True), "a host tier"),
             (dict(layer_stream="host"), "the layer stream cache")]
    hf = NS(model_type="m", architectures=["MForCausalLM"])
    for options, needle in cases:
        config = SwiftConfig(enabled=True, **options)
        (why,) = refusals(ctx, config)
        assert why.startswith(needle), why
        full = NS(model_config=NS(hf_config=hf), server_args=NS(), params=NS(), tp_size=1,
                  full_tokens_per_layer=SLOTS, **{flag: True})
        with pytest.raises(ValueError, match=f"{needle}.*model type 'm' \\(MForCausalLM\\), "
                                             f"hybrid"):
            create_swift_tree_cache(full, config)
    tp = NS(tp_size=2, full_tokens_per_layer=SLOTS, **{flag: True})
    assert refusals(tp, SwiftConfig(enabled=True, lend_fraction=0.5))[0].startswith(
        f"lending from a hybrid {kind} model with --tp 2")
    if flag == "is_hybrid_swa":
        pure = NS(tp_size=1, full_tokens_per_layer=0, is_hybrid_swa=True)
        assert "every layer is sliding-window" in refusals(
            pure, SwiftConfig(enabled=True, lend_fraction=0.5))[0]
