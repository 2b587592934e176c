"""MLA pools on both sides of a pool lease, with SGLang's own MLATokenToKVPool on CPU.

A donor's pool is described to borrowers by the bytes of a row per layer (`PoolLayout`): an MLA
pool has one latent buffer per layer (a latent `KVGeometry`, rows of kv_lora_rank +
qk_rope_head_dim elements, no V rows). The plugin's hook places those buffers in one shared
region with SGLang's shapes; a borrower of any supported shape (an MHA pool, bf16 or fp8, or an
MLA pool) keeps its rows in the lent pages and gets them back byte-identical, nothing outside
the lent pages is written, and a reclaim fences exactly the blocks on the pages taken back,
through the live agents too. An MLA borrower's page is its latent rows, kept in an MHA or an MLA
donor's lent pages alike. MLA pools keeping more than the latent rows (DSA's indexer) neither
lend nor borrow: refused with the reason.
"""

from __future__ import annotations

import pytest
import torch

from radix_ext import DONOR, RadixTree
from sglang_swift.config import CONFIG_ENV, SwiftConfig
from sglang_swift.control.protocol import PoolLayoutMsg
from sglang_swift.dataplane import UnshareablePool, make_layer_counter
from sglang_swift.dataplane.pool_layout import PoolLayout
from sglang_swift.dataplane.pool_lease import (
    lending_page,
    pool_buffers,
    pool_device,
    pool_geometry,
    why_pool_cannot_lend,
    why_pool_unshareable,
)
from sglang_swift.integration.runtime import SwiftRuntime
from sglang_swift.integration.shared_kv_pool import shared_region_of
from swift_kernels import K, KVGeometry, V
from tests.unit.test_models_fp8 import (
    LENDING,
    PAGE,
    lend_round_trip,
    mha_pool,
    raw,
    write_kv,
)

LORA, ROPE = 16, 8  # latent row: 24 elements


@pytest.fixture(scope="module", autouse=True)
def lending_hooks():
    from tests.unit.test_runtime import apply_lending_hooks

    apply_lending_hooks()


def mla_pool(dtype, monkeypatch, lend: bool, size: int = 124, page: int = PAGE, **kw):
    """SGLang's MLATokenToKVPool; `lend`: built as a lending server's scheduler builds it."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    if lend:
        monkeypatch.setenv(CONFIG_ENV, LENDING.to_json())
    pool = MLATokenToKVPool(size=size, page_size=page, dtype=dtype, kv_lora_rank=LORA,
                            qk_rope_head_dim=ROPE, layer_num=3, device="cpu",
                            enable_memory_saver=False, **kw)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    return pool


def fill_latent(pool, seed: int, pages=None) -> None:
    """Latent rows (of `pages`, default every slot) written as SGLang's MLA store writes them:
    values of the pool's dtype in its storage dtype, into `kv_buffer[layer][slots]`."""
    gen = torch.Generator().manual_seed(seed)
    rows, page = pool.size + pool.page_size, pool.page_size
    loc = (torch.arange(rows) if pages is None else
           torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages]))
    for buf in pool.kv_buffer:
        values = (torch.randn(loc.numel(), 1, LORA + ROPE, generator=gen) * 3).to(pool.dtype)
        buf[loc] = values.view(pool.store_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_an_mla_donors_latent_buffers_are_one_shared_region_described_in_bytes(dtype,
                                                                                monkeypatch):
    """Invariant: a lending MLA server's latent buffers keep SGLang's shapes and live in one
    shared region at `PoolLayout.chunk_offset(page, layer, K)` (no V rows); the layout travels
    as the wire's flat fields (one head of the latent width, v_head_dim 0) and comes back
    equal; a server that does not lend keeps SGLang's own buffers."""
    pool = mla_pool(dtype, monkeypatch, lend=True)
    arena, layout = shared_region_of(pool)
    store = "uint8" if dtype == torch.float8_e4m3fn else "bfloat16"
    assert layout.geometry == KVGeometry.latent_page(3, LORA + ROPE, store, PAGE) \
        == lending_page(pool) == pool_geometry(pool)
    assert layout.latent and layout.chunk_bytes(V) == 0
    assert pool.kv_buffer[0].shape == (124 + PAGE, 1, LORA + ROPE)
    assert pool_device(pool) == torch.device("cpu")
    fill_latent(pool, seed=1)
    region = arena.memory.view(-1)
    for page in (0, 7, 31):
        for layer in range(3):
            off = layout.chunk_offset(page, layer, K)
            assert torch.equal(region[off: off + layout.chunk_bytes(K)],
                               raw(pool.kv_buffer[layer][page * PAGE:(page + 1) * PAGE]))
    wire = layout.to_dict()
    assert (wire["head_num"], wire["head_dim"], wire["v_head_dim"]) == (1, LORA + ROPE, 0)
    assert PoolLayout.from_dict(PoolLayoutMsg(**wire)) == layout
    with pytest.raises(ValueError, match="latent page.*one head"):
        PoolLayout.from_dict({**wire, "head_num": 2})
    arena.close()
    assert shared_region_of(mla_pool(dtype, monkeypatch, lend=False)) is None


@pytest.mark.parametrize("mine, theirs", [
    (torch.bfloat16, torch.bfloat16), (torch.float8_e4m3fn, torch.bfloat16),
    (torch.bfloat16, torch.float8_e4m3fn)], ids=["bf16-into-bf16", "fp8-into-bf16",
                                                  "bf16-into-fp8"])
def test_a_borrowers_rows_in_an_mla_donors_pages_come_back_identical(mine, theirs, monkeypatch):
    """Invariant: an MHA borrower's rows stored in an MLA donor's lent latent pages come back
    byte-identical, no byte of the donor's own pages (its latent rows) changes, and a reclaim
    refuses exactly the blocks on the pages taken back while the rest still load identical."""
    donor = mla_pool(theirs, monkeypatch, lend=True)
    borrower = mha_pool(mine, monkeypatch, lend=False, size=124, layer_num=5, head_num=1,
                        head_dim=16)
    fill_latent(donor, seed=2)
    write_kv(borrower, seed=3)
    lent = [8, 2, 30, 5, 12, 21, 3, 16, 27, 10, 1, 19, 24, 7, 29, 14, 22, 6, 17, 26]
    lend_round_trip(donor, borrower, lent_pages=lent,
                    reclaimed_pages=[30, 12],
                    scribble=lambda pages: fill_latent(donor, seed=4, pages=pages))
    shared_region_of(donor)[0].close()


@pytest.mark.parametrize("donor_kind", ["mha", "mla"])
@pytest.mark.parametrize("mine", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_an_mla_borrowers_latent_rows_in_a_donors_pages_come_back_identical(mine, donor_kind,
                                                                            monkeypatch):
    """Invariant: an MLA borrower's latent rows (its page: one row per layer, no V rows) stored
    in an MHA or an MLA donor's lent pages come back byte-identical into poisoned slots, SGLang's
    MLA reads see the same values, nothing outside the lent pages is written, and a reclaim
    refuses exactly the blocks on the pages taken back."""
    from tests.unit.test_models_fp8 import mha_scribble

    borrower = mla_pool(mine, monkeypatch, lend=False, size=400)  # a block per donor page or more
    fill_latent(borrower, seed=7)
    g = pool_geometry(borrower)
    assert g.latent and g.halves == (K,) and g.page_bytes == 3 * PAGE * (LORA + ROPE) * (
        borrower.kv_buffer[0].element_size())
    ks, vs = pool_buffers(borrower)
    assert ks == borrower.kv_buffer and vs == []
    if donor_kind == "mla":
        donor = mla_pool(torch.bfloat16, monkeypatch, lend=True)
        fill_latent(donor, seed=8)
        scribble = lambda pages: fill_latent(donor, seed=9, pages=pages)  # noqa: E731
    else:
        donor = mha_pool(torch.bfloat16, monkeypatch, lend=True, size=124)
        write_kv(donor, seed=8)
        scribble = mha_scribble(donor, seed=9)
    lent = [8, 2, 30, 5, 12, 21, 3, 16, 27, 10, 1, 19, 24, 7, 29, 14, 22, 6, 17, 26]
    lend_round_trip(donor, borrower, lent_pages=lent, reclaimed_pages=[30, 12],
                    scribble=scribble)
    shared_region_of(donor)[0].close()


def test_dsa_pools_neither_lend_nor_borrow_and_say_why(monkeypatch):
    """Invariant: an MLA pool with a DSA indexer beside its latent rows lends nothing and keeps
    no borrower's rows, and says so, at the hook (built as SGLang's own) and when its page is
    asked for; SGLang's plain MLA pool does both."""
    pool = mla_pool(torch.bfloat16, monkeypatch, lend=False)
    assert why_pool_cannot_lend(pool) is None and why_pool_unshareable(pool) is None
    dsa = mla_pool(torch.bfloat16, monkeypatch, lend=True, use_dsa=True)
    assert shared_region_of(dsa) is None
    assert "DSA" in why_pool_cannot_lend(dsa) and "DSA" in why_pool_unshareable(dsa)
    with pytest.raises(UnshareablePool, match="cannot be lent.*DSA"):
        lending_page(dsa)
    with pytest.raises(UnshareablePool, match="cannot be shared.*DSA"):
        pool_geometry(dsa)


SLOTS = 64
BORROWER_SHAPE = dict(layer_num=5, head_num=1, head_dim=16)


def _runtime(tmp_path, monkeypatch, name, pool, allocator, **cfg) -> SwiftRuntime:
    config = SwiftConfig(enabled=True, rendezvous_dir=str(tmp_path / "rv"),
                         heartbeat_interval_s=0.05, heartbeat_timeout_s=2.0, **cfg)
    return SwiftRuntime(config, model=name, kv_pool=pool, allocator=allocator,
                        tree=RadixTree(config.tree_config(1)), page_size=1, agent_id=name)


def _allocator(pool):
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    return TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", pool, need_sort=False)


def store_and_load_back(borrower, borrower_pool) -> None:
    """A borrower runtime's prefix (8 tokens in slots 1-8) demoted into its donor tier and
    loaded back into slots 30-37 through the live agents: its rows come back bit-identical."""
    from tests.unit.test_runtime import _copy

    tree = borrower.tree
    buffers = [b for half in pool_buffers(borrower_pool) for b in half]
    expect = [raw(b[1:9]).clone() for b in buffers]
    tree.insert(list(range(100, 108)), list(range(1, 9)))
    (ticket,) = tree.evict_device(8).stores
    assert ticket.dst_tier == DONOR
    dst = ticket.transfer.dst
    assert _copy(borrower, (dst.donor, dst.lease), ticket.src.indices, dst.blocks)
    tree.complete_store(ticket)
    m = tree.match(list(range(100, 108)))
    assert m.load_len == 8
    load = tree.begin_load_back(m.last_node, list(range(30, 38)))
    (c,) = load.copies
    counter = make_layer_counter(borrower_pool.layer_num)
    assert _copy(borrower, (c.src.donor, c.src.lease), c.dst.indices, c.src.blocks, counter)
    assert tree.complete_load_back(load).ok
    for buf, want in zip(buffers, expect, strict=True):
        assert torch.equal(raw(buf[30:38]), want)


@pytest.mark.parametrize("borrower_kind", ["fp8-mha", "mla"])
def test_an_mla_donor_lends_and_reclaims_through_live_agents(borrower_kind, tmp_path,
                                                             monkeypatch):
    """Invariant (the reclaim guarantee, an MLA donor): its latent pages leave its allocator
    when lent, a borrower's demoted prefix (an fp8 MHA borrower's K and V rows, or an MLA
    borrower's latent rows) loads back bit-identical from them, and when the donor's own
    traffic needs them every page comes back into its allocator only after the borrower
    acknowledged, with the borrower's tree holding no donor block."""
    from tests.unit.test_runtime import _pump_until

    donor_pool = mla_pool(torch.bfloat16, monkeypatch, lend=True, size=SLOTS, page=1)
    fill_latent(donor_pool, seed=5)
    if borrower_kind == "mla":
        borrower_pool = mla_pool(torch.float32, monkeypatch, lend=False, size=SLOTS, page=1)
        fill_latent(borrower_pool, seed=6)
    else:
        borrower_pool = mha_pool(torch.float8_e4m3fn, monkeypatch, lend=False, size=SLOTS,
                                 page=1, **BORROWER_SHAPE)
        write_kv(borrower_pool, seed=6)
    donor = _runtime(tmp_path, monkeypatch, "mla-donor", donor_pool, _allocator(donor_pool),
                     role="donor", lend_fraction=0.5)
    borrower = _runtime(tmp_path, monkeypatch, f"{borrower_kind}-borrower", borrower_pool,
                        _allocator(borrower_pool), role="borrower", max_borrow_blocks=16)
    assert donor.geometry.latent and borrower.geometry.latent == (borrower_kind == "mla")
    donor.start()
    borrower.start()
    try:
        _pump_until((donor, borrower), lambda: borrower.tree.donor.capacity_tokens() > 0)
        assert donor.lent_tokens == 32 and donor.allocator.available_size() == 32
        tree = borrower.tree
        store_and_load_back(borrower, borrower_pool)
        own = donor.allocator.alloc(donor.allocator.available_size())  # its own burst
        assert own is not None
        _pump_until((donor, borrower), lambda: donor.lent_tokens == 0)
        assert borrower.stats["reclaims"] > 0 and tree.tier_size(DONOR) == 0
        assert donor.allocator.available_size() == 32  # every lent page back, after the ack
        tree.check_integrity()
        donor.lender.check_integrity()
    finally:
        borrower.stop()
        donor.stop()
        shared_region_of(donor_pool)[0].close()


@pytest.mark.parametrize("flag, needle", [("is_dsa", "DSA attention \\(an indexer cache")])
def test_start_up_refusals_name_the_attention_type_and_the_reason(flag, needle):
    """Invariant: a model kind the tree does not serve is refused at start-up naming its
    attention, the model type and why (hybrid models, by role: test_models_hybrid.py)."""
    from types import SimpleNamespace as NS

    from sglang_swift.integration.backend import attention_kind, create_swift_tree_cache

    hf = NS(model_type="m", architectures=["MForCausalLM"])
    ctx = NS(model_config=NS(hf_config=hf), params=NS(eviction_policy="lru"), tp_size=1,
             **{flag: True})
    with pytest.raises(ValueError, match=f"{needle}.*model type 'm' \\(MForCausalLM\\)"):
        create_swift_tree_cache(ctx, SwiftConfig(enabled=True))
    plain = NS(model_config=NS(hf_config=hf))
    assert attention_kind(plain) == "MHA/GQA attention"
    hf.kv_lora_rank = 512
    assert attention_kind(plain) == "MLA attention"


def test_a_host_tier_serves_a_plain_mla_pool_and_refuses_one_with_more_beside_its_rows(
        monkeypatch):
    """Invariant: SwiftCache's host tier serves SGLang's plain MLA pool (its MLA host pool); an
    MLA pool keeping more beside its latent rows (DSA's indexer) asking for one is refused at
    start-up naming the pool and the reason, with the model's attention, not failed inside
    SGLang's host pool."""
    from types import SimpleNamespace as NS

    from sglang_swift.integration.backend import create_swift_tree_cache, host_tier_problems

    config = SwiftConfig(enabled=True, host_tier=True)

    def params(pool):
        return NS(eviction_policy="lru", token_to_kv_pool_allocator=NS(get_kvcache=lambda: pool))

    assert host_tier_problems(params(mla_pool(torch.bfloat16, monkeypatch, lend=False)),
                              config) == []
    dsa = mla_pool(torch.bfloat16, monkeypatch, lend=False, use_dsa=True)
    hf = NS(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], kv_lora_rank=LORA)
    ctx = NS(model_config=NS(hf_config=hf), tp_size=1, params=params(dsa))
    with pytest.raises(ValueError, match="host tier .* on MLATokenToKVPool: .*plain MLA pool.*"
                                         "deepseek_v2.*MLA attention"):
        create_swift_tree_cache(ctx, config)


def latent_donor(pages: int = 160):
    """test_layer_stream_donor's donor with an MLA donor's layout: one latent buffer per layer,
    rows of 16 float32 (192 B a page over 3 layers, as that test's K/V donor page)."""
    from sglang_swift.dataplane import SharedArena
    from sglang_swift.dataplane.pool_lease import map_pool
    from tests.unit.test_layer_stream_donor import Donor
    from tests.unit.test_pool_transfer import POISON as FILL

    class LatentDonor(Donor):
        def __init__(self):
            self.layout = PoolLayout(KVGeometry.latent_page(3, 16, "float32", 1), rows=pages,
                                     padded_rows=pages)
            self.arena = SharedArena(-(-self.layout.data_bytes // 512) * 512)
            self.arena.memory.view(-1).fill_(FILL)
            self.mapped = map_pool({**self.arena.export(), "layout": self.layout.to_dict()})
            self.up, self.leases = True, 0

    return LatentDonor()


@pytest.mark.parametrize("order", ["write-first", "read-first"])
def test_a_streaming_server_reads_from_an_mla_donors_pages_through_a_reclaim(order):
    """Invariant: the layer stream cache's store kept in an MLA donor's latent pages reads what
    SGLang's own pool reads through a reclaim mid-forward and a dead donor, with reads served
    from the donor's memory while it held pages (test_layer_stream_donor's check, this
    donor)."""
    from tests.unit.test_layer_stream_donor import (
        test_reclaim_and_dead_donor_mid_forward_leave_every_read_unchanged as check,
    )

    donor = latent_donor()
    try:
        check(donor, order, shuffle_slots=True, max_runs=4)
    finally:
        donor.close()


def test_an_mla_borrower_with_tp_and_a_streamed_mla_pool_are_refused_naming_mla(monkeypatch):
    """Invariant: what an MLA server does not do is refused at start-up naming MLA and why:
    borrowing with --tp > 1 (every rank holds the same latent rows) and the layer stream cache
    (it streams an MHA pool's K and V rows), before any memory is sized for it."""
    from types import SimpleNamespace as NS

    from sglang_swift.config import CONFIG_ENV
    from sglang_swift.integration.backend import create_swift_tree_cache
    from sglang_swift.layer_stream.hooks import around_config_from_budget

    hf = NS(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], kv_lora_rank=512)
    ctx = NS(model_config=NS(hf_config=hf), params=NS(eviction_policy="lru"), tp_size=2)
    borrower = SwiftConfig(enabled=True, role="borrower", max_borrow_blocks=8)
    with pytest.raises(ValueError, match="borrowing with --tp 2 on MLA attention.*same latent "
                                         "rows.*\\(model type 'deepseek_v2'.*MLA attention\\)"):
        create_swift_tree_cache(ctx, borrower)
    monkeypatch.setenv(CONFIG_ENV, SwiftConfig(enabled=True, layer_stream="host").to_json())
    sized = []
    configurator = NS(is_draft_worker=False, use_mla_backend=True)
    with pytest.raises(ValueError, match="MLA attention.*not streamed"):
        around_config_from_budget(lambda *a, **k: sized.append(a), configurator, 1 << 30)
    assert sized == []
    configurator.use_mla_backend = False  # the same call sizes an MHA model's streamed pool
    with pytest.raises(AttributeError):  # (this stand-in has no layer_info past the check)
        around_config_from_budget(lambda *a, **k: sized.append(a), configurator, 1 << 30)
