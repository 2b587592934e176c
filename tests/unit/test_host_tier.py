"""The host tier of SwiftCache's tree on SGLang's own host pool (integration/host_tier.py).

Invariants: a store then a load through SGLang's host pool returns the device rows bit for bit
for every io-backend/layout pair the CPU venv serves; a tree with a host tier demotes device
victims there and a later match loads them back layer by layer before attention reads them
(the request's prefix slots hold the original KV after the device rows were overwritten);
HiCache options the host tier does not honour are refused with the option named.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

SLOTS = 64
LAYERS = 3
SERVED = [("layer_first", "kernel"), ("layer_first", "direct"), ("page_first", "kernel"),
          ("page_first_direct", "direct")]


def _device_pool(size: int = SLOTS, page_size: int = 1):
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(size=size, page_size=page_size, dtype=torch.float32, head_num=2,
                            head_dim=8, layer_num=LAYERS, device="cpu",
                            enable_memory_saver=False, v_head_dim=8, start_layer=0,
                            end_layer=LAYERS - 1)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn_like(buf))
    return pool, TokenToKVPoolAllocator(size, torch.float32, "cpu", pool, need_sort=False)


def _host(pool, layout="layer_first", io="kernel", ratio=2.0, page_size=1):
    from sglang_swift.integration.host_tier import HostKV

    return HostKV(pool, ratio=ratio, size_gb=0, layout=layout, io_backend=io,
                  page_size=page_size)


@pytest.mark.parametrize("layout,io", SERVED)
def test_a_store_and_a_load_through_sglangs_host_pool_return_the_rows(layout, io):
    pool, _ = _device_pool()
    host = _host(pool, layout, io)
    assert host.capacity >= 2 * SLOTS  # --hicache-ratio 2 of the device pool
    src = torch.arange(3, 19)
    want = [(pool.k_buffer[layer][src].clone(), pool.v_buffer[layer][src].clone())
            for layer in range(LAYERS)]
    slots = torch.arange(40, 56)
    host.store(src, slots)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.zero_()
    dst = torch.arange(20, 36)
    for layer in range(LAYERS):
        host.load_layer(slots, dst, layer)
        assert torch.equal(pool.k_buffer[layer][dst], want[layer][0])
        assert torch.equal(pool.v_buffer[layer][dst], want[layer][1])


def _mla_device_pool(size: int = SLOTS):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(size=size, page_size=1, dtype=torch.float32, kv_lora_rank=16,
                            qk_rope_head_dim=8, layer_num=LAYERS, device="cpu",
                            enable_memory_saver=False, start_layer=0, end_layer=LAYERS - 1)
    for buf in pool.kv_buffer:
        buf.copy_(torch.randn_like(buf))
    return pool


@pytest.mark.parametrize("layout,io", SERVED)
def test_an_mla_pools_latent_rows_go_through_sglangs_mla_host_pool_and_back(layout, io):
    """Invariant: an MLA device pool's host tier is SGLang's MLA host pool; a store then a load
    return its latent rows bit for bit, and rows a reclaim writes by layer (`write_rows`, the
    row layouts) load back as written."""
    from sglang_swift.integration.host_tier import ROW_LAYOUTS

    pool = _mla_device_pool()
    host = _host(pool, layout, io)
    assert host.latent and type(host.pool).__name__ == "MLATokenToKVPoolHost"
    assert host.token_bytes == LAYERS * 24 * 4 and host.capacity >= 2 * SLOTS
    src, slots, dst = torch.arange(3, 19), torch.arange(40, 56), torch.arange(20, 36)
    want = [pool.kv_buffer[layer][src].clone() for layer in range(LAYERS)]
    host.store(src, slots)
    for buf in pool.kv_buffer:
        buf.zero_()
    for layer in range(LAYERS):
        host.load_layer(slots, dst, layer)
        assert torch.equal(pool.kv_buffer[layer][dst], want[layer])
        assert not pool.kv_buffer[layer][:20].any()  # nothing outside the slots named
    if layout not in ROW_LAYOUTS:
        return
    rescued = [torch.randn(4, 1, 24) for _ in range(LAYERS)]
    host.write_rows(torch.arange(60, 64), rescued, [])
    for layer in range(LAYERS):
        host.load_layer(torch.arange(60, 64), torch.arange(4, 8), layer)
        assert torch.equal(pool.kv_buffer[layer][4:8], rescued[layer])


class Rig:
    """A SwiftRadixCache with a host tier and no control channel, on SGLang's real pools."""

    def __init__(self, layout="layer_first", io="kernel"):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        from sglang_swift.config import SwiftConfig
        from sglang_swift.integration.build import build_cache

        self.pool, self.alloc = _device_pool()
        self.host = _host(self.pool, layout, io)
        self.registered = []
        config = SwiftConfig(enabled=True, host_tier=True)
        tp_worker = SimpleNamespace(register_hicache_layer_transfer_counter=self.registered.append)
        self.cache = build_cache(
            CacheInitParams(disable=False, req_to_token_pool=None,
                            token_to_kv_pool_allocator=self.alloc, page_size=1),
            config.tree_config(1, self.host.capacity), config, tp_worker=tp_worker,
            host_kv=self.host)

    def insert(self, tokens):
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        slots = self.alloc.alloc(len(tokens))
        for layer in range(LAYERS):  # each token's KV names the token and the layer
            t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
            self.pool.k_buffer[layer][slots] = t * 10 + layer
            self.pool.v_buffer[layer][slots] = -(t * 10 + layer)
        r = self.cache.insert(InsertParams(key=RadixKey(list(tokens)), value=slots))
        if r.prefix_len:  # duplicates of what the tree holds: freed by the caller, as SGLang
            self.alloc.free(slots[:r.prefix_len])

    def match(self, tokens):
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens))))

    def admit(self, tokens, rid="r"):
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        m = self.match(tokens)
        req = SimpleNamespace(rid=rid, last_node=m.last_device_node, prefix_len=m.device_prefix_len,
                              full_untruncated_fill_ids=list(tokens) + [0],
                              skip_radix_cache_insert=False, discard_output_reason=None)
        out = self.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length,
                                                           req=req))
        req.prefix_len += out[0]
        return req, m, out

    def kv_is(self, slots, tokens) -> bool:
        want = torch.tensor(tokens, dtype=torch.float32)
        return all(torch.equal(self.pool.k_buffer[layer][slots][:, 0, 0], want * 10 + layer)
                   and torch.equal(self.pool.v_buffer[layer][slots][:, 0, 0],
                                   -(want * 10 + layer))
                   for layer in range(LAYERS))


@pytest.mark.parametrize("layout,io", SERVED)
def test_evicted_prefixes_go_to_host_and_load_back_before_attention_reads_them(layout, io):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from radix_ext import HOST

    rig = Rig(layout, io)
    tokens = list(range(100, 124))
    rig.insert(tokens)
    rig.cache.evict(EvictParams(num_tokens=rig.cache.evictable_size()))
    assert rig.cache.tree.tier_size(HOST) == len(tokens)
    assert rig.cache.stats["host_stored_tokens"] == len(tokens)
    assert rig.alloc.available_size() == SLOTS  # the device slots came back at once
    for buf in rig.pool.k_buffer + rig.pool.v_buffer:  # the freed rows are reused meanwhile
        buf.fill_(7777.0)
    req, m, out = rig.admit(tokens + [1, 2])
    assert m.device_prefix_len == 0 and m.host_hit_length == len(tokens)
    assert out[0] == len(tokens)
    slots = rig.cache.prefix_device_indices(req)  # what prepare_for_extend writes to its row
    batch = SimpleNamespace(hicache_consumer_index=-1)
    rig.cache.swift_batch_built(batch)
    assert batch.hicache_consumer_index >= 0
    counter = rig.cache.donor_hits.counter
    counter.set_consumer(batch.hicache_consumer_index)
    assert all(counter.wait_until(layer) for layer in range(LAYERS))
    counter.set_consumer(-1)
    assert rig.kv_is(slots, tokens)
    rig.cache.swift_batch_ran(SimpleNamespace(chunked_req=None), batch)
    assert req.discard_output_reason is None
    assert rig.cache.stats["host_loaded_tokens"] == len(tokens)
    assert rig.cache.stats["host_hit_tokens"] == len(tokens)
    rig.cache.swift_step(None)  # closes the ticket
    rig.cache.check_integrity()


def test_a_full_host_tier_drops_its_least_recently_used_prefix():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from radix_ext import HOST

    rig = Rig()
    cap = rig.host.capacity
    first, second = list(range(0, 40)), list(range(1000, 1040))
    while rig.cache.tree.tier_size(HOST) + 40 <= cap:  # fill host with other prefixes
        base = 5000 + rig.cache.tree.tier_size(HOST) * 10
        rig.insert(list(range(base, base + 40)))
        rig.cache.evict(EvictParams(num_tokens=rig.cache.evictable_size()))
    rig.insert(first)
    rig.cache.evict(EvictParams(num_tokens=rig.cache.evictable_size()))
    rig.insert(second)
    rig.cache.evict(EvictParams(num_tokens=rig.cache.evictable_size()))
    assert rig.cache.tree.tier_size(HOST) <= cap
    assert rig.match(second).host_hit_length == len(second)
    rig.cache.check_integrity()


def test_hicache_options_the_host_tier_does_not_honour_are_refused_by_name():
    from sglang_swift.config import SwiftConfig
    from sglang_swift.integration.host_tier import host_tier_problems

    ok = SimpleNamespace(hicache_write_policy="write_back", hicache_storage_backend=None,
                         hicache_host_memory_mode="cache")
    assert host_tier_problems(ok, SwiftConfig(enabled=True)) == []
    assert host_tier_problems(SimpleNamespace(**{**ok.__dict__,
                                                 "hicache_write_policy": "write_through"}),
                              SwiftConfig(enabled=True)) == []
    bad = SimpleNamespace(hicache_write_policy="write_through_selective",
                          hicache_storage_backend="file", hicache_host_memory_mode="buffer_only")
    problems = host_tier_problems(bad, SwiftConfig(enabled=True))
    text = "; ".join(problems)
    assert len(problems) == 2  # L3 (--hicache-storage-backend) is served: test_storage_tier.py
    for option in ("--hicache-write-policy write_through_selective",
                   "--hicache-host-memory-mode buffer_only"):
        assert option in text
    streamed = host_tier_problems(ok, SwiftConfig.parse(enabled=True, layer_stream="host"))
    assert len(streamed) == 1 and "--swiftcache-layer-stream" in streamed[0]


def _tree_with_donor_prefixes(host_capacity: int):
    """A tree whose two prefixes (a shared 4-token root, then two 6-token branches) were
    demoted into one donor lease."""
    from array import array

    from radix_ext import RadixTree, TreeConfig, admission

    tree = RadixTree(TreeConfig(page_size=1, donor=True, host_capacity=host_capacity,
                                cascade="off"))
    tree.donor.add_lease("d", 0, 1, 32)
    a = array("q", [1, 2, 3, 4, 10, 11, 12, 13, 14, 15])
    b = array("q", [1, 2, 3, 4, 20, 21, 22, 23, 24, 25])
    tree.insert(a, array("q", range(10)), None)
    tree.insert(b, array("q", range(10, 20)), None)
    plan = tree.evict_device(16)
    admission.settle(tree, plan.stores, [True] * len(plan.stores))
    return tree, a, b


def test_a_rescue_keeps_every_revoked_prefix_in_host_and_loses_nothing():
    from radix_ext import DONOR, HOST

    tree, a, b = _tree_with_donor_prefixes(host_capacity=64)
    assert tree.tier_size(DONOR) == 16
    result = tree.revoke("d", rescue=True)
    assert result.num_tokens_lost == 0 and result.lost_paths == ()
    assert sum(len(t.dst.indices) for t in result.moved) == 16
    assert all((t.src_tier, t.dst_tier) == (DONOR, HOST) for t in result.moved)
    assert [x.res[HOST] for x in result.moved_nodes] == [t.dst for t in result.moved]
    for key in (a, b):
        m = tree.match(key, None)
        assert m.prefix_len == 10 and {s.tier for s in m.loads} == {HOST}
    tree.check_integrity()


def test_a_rescue_leaves_a_prefix_back_on_the_device_where_it_is_and_keeps_host_room():
    """b was loaded back onto the device (its donor copy kept, as a lower copy): a reclaim
    moves only a's own 6 tokens into host (b and the shared root stay on the device, whose
    eviction stores them again), so 10 host slots keep everything; rescuing b too would need
    16 and lose a prefix."""
    from array import array

    from radix_ext import DEVICE, HOST

    tree, a, b = _tree_with_donor_prefixes(host_capacity=10)
    m = tree.match(b, None)
    ticket = tree.begin_load_back(m.last_node, array("q", range(100, 110)))
    assert tree.complete_load_back(ticket).ok
    tree.unlock(m.last_node)
    result = tree.revoke("d", rescue=True)
    assert result.num_tokens_lost == 0 and result.unrescued == ()
    assert [len(t.dst.indices) for t in result.moved] == [6]
    assert tree.match(b, None).device_len == 10
    m = tree.match(a, None)
    assert m.prefix_len == 10 and m.device_len == 4 and [s.tier for s in m.loads] == [HOST]
    assert DEVICE in tree.match(b, None).last_device_node.res
    tree.check_integrity()


def test_without_host_room_a_reclaim_loses_the_prefixes_and_their_reuse_is_counted_once():
    from sglang_swift.integration.reclaim_loss import ReclaimLoss

    tree, a, b = _tree_with_donor_prefixes(host_capacity=0)
    result = tree.revoke("d", rescue=True)
    assert result.num_tokens_lost == 16 and result.moved == ()
    assert sorted(list(p.tokens) for p in result.lost_paths) == sorted([list(a), list(b)])
    loss = ReclaimLoss()
    loss.add(result.lost_paths)
    assert loss.recomputed(list(a) + [99], None, 0) == 10  # all of a, nothing of b
    assert loss.recomputed(list(a), None, 0) == 0  # already counted: prefilled again then
    assert loss.recomputed(list(b), None, 4) == 6  # its first 4 tokens were cached again
    assert not loss
    assert loss.recomputed(list(b), "other namespace", 0) == 0


def test_held_tokens_count_a_prefix_once_whatever_tiers_hold_it():
    """The shared root and both branches in the donor tier (16 tokens); b loaded back onto the
    device keeps its donor copies; a reclaim then finds no room for a's 6-token branch in a
    4-token host tier (the root and b stay on the device): each state counts every cached token
    once."""
    from array import array

    from radix_ext import DONOR

    tree, a, b = _tree_with_donor_prefixes(host_capacity=4)
    assert tree.held_tokens() == 16 and tree.device_size() == 0
    m = tree.match(b, None)
    ticket = tree.begin_load_back(m.last_node, array("q", range(100, 110)))
    assert tree.complete_load_back(ticket).ok
    tree.unlock(m.last_node)
    assert tree.device_size() == 10 and tree.tier_size(DONOR) == 16
    assert tree.held_tokens() == 16
    result = tree.revoke("d", rescue=True)
    assert result.num_tokens_lost == 6  # a's branch: the host tier holds only 4 tokens
    assert tree.held_tokens() == 10
    tree.check_integrity()


def test_a_rescue_names_each_donor_copy_it_found_no_host_room_for():
    """Host room for the shared 4-token root only: the two branches are dropped, and
    `unrescued` names each (its path's tokens, where its own tokens start, its donor blocks),
    read before the drop, for a caller that writes them to L3 from the staged rows."""
    from radix_ext import HOST

    tree, a, b = _tree_with_donor_prefixes(host_capacity=4)
    result = tree.revoke("d", rescue=True)
    assert [len(t.dst.indices) for t in result.moved] == [4]
    assert sorted((list(u.tokens), u.start) for u in result.unrescued) == \
        sorted([(list(a), 4), (list(b), 4)])
    assert all(len(u.src.blocks) == 6 for u in result.unrescued)
    assert result.num_tokens_lost == 12
    m = tree.match(a, None)
    assert m.prefix_len == 4 and {s.tier for s in m.loads} == {HOST}
    tree.check_integrity()


def test_tokens_of_a_lost_prefix_count_as_recomputed_only_when_the_tree_gets_them_new():
    """The cache counts a reclaim's loss at insert: a lost prefix whose first part is in the
    tree before the prefill (as an L3 fetch attaches host copies before the admission match)
    counts only the rest, the part the prefill made new; matching
    alone counts nothing, and a second insert of the same tokens nothing more."""
    from radix_ext.results import LostPrefix

    rig = Rig()
    lost = list(range(500, 512))
    rig.insert(lost[:5])  # back in the tree before this request's prefill (not watched yet)
    rig.cache.control.reclaim_loss.add([LostPrefix(None, lost, 0)])
    rig.match(lost + [1])
    assert rig.cache.stats["recomputed_after_reclaim_tokens"] == 0
    rig.insert(lost + [1])
    assert rig.cache.stats["recomputed_after_reclaim_tokens"] == 12 - 5
    rig.insert(lost + [1, 2])
    assert rig.cache.stats["recomputed_after_reclaim_tokens"] == 7


def test_write_through_backs_up_the_path_and_an_eviction_then_copies_nothing():
    """write_through: every prefix the tree takes gets its host copy at once (root first), the
    bytes equal the device rows; evicting it later frees the device slots without a store, and
    a match loads it from host."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from radix_ext import HOST

    rig = Rig()
    rig.host.write_through = True
    tokens = list(range(300, 320))
    rig.insert(tokens)
    assert rig.cache.tree.tier_size(HOST) == len(tokens)
    assert rig.cache.stats["host_stored_tokens"] == len(tokens)
    rig.insert(tokens + [1, 2, 3, 4])  # only the new tail is copied
    assert rig.cache.stats["host_stored_tokens"] == len(tokens) + 4
    stores = rig.cache.stats["stores_started"]
    rig.cache.evict(EvictParams(num_tokens=rig.cache.evictable_size()))
    assert rig.cache.stats["stores_started"] == stores  # nothing copied by the eviction
    assert rig.alloc.available_size() == SLOTS
    for buf in rig.pool.k_buffer + rig.pool.v_buffer:
        buf.fill_(7777.0)
    m = rig.match(tokens + [1, 2, 3, 4])
    assert m.device_prefix_len == 0 and m.host_hit_length == len(tokens) + 4
    rows = torch.tensor([i for seg in rig.cache.tree.match(tokens + [1, 2, 3, 4]).loads
                         for i in seg.source.indices])
    dst = torch.arange(len(rows))
    for layer in range(LAYERS):
        rig.host.load_layer(rows, dst, layer)
    assert rig.kv_is(dst, tokens + [1, 2, 3, 4])
    rig.cache.check_integrity()


def test_write_through_with_a_donor_tier_keeps_a_donor_copy_and_a_reclaim_loses_nothing():
    from array import array

    from radix_ext import DONOR, HOST, RadixTree, TreeConfig, admission

    tree = RadixTree(TreeConfig(page_size=1, donor=True, host_capacity=64, cascade="off",
                                donor_over_host=True))
    tree.donor.add_lease("d", 0, 1, 32)
    key = array("q", range(50, 62))
    r = tree.insert(key, array("q", range(12)), None)
    (t,), _ = tree.back_up(r.last_node, HOST)
    assert (t.src_tier, t.dst_tier, len(t.dst.indices)) == ("device", HOST, 12)
    plan = tree.evict_device(12)
    assert [s.dst_tier for s in plan.stores] == [DONOR]  # a faster copy beside the host one
    admission.settle(tree, plan.stores, [True])
    m = tree.match(key, None)
    assert [s.tier for s in m.loads] == [DONOR]  # loads from the faster copy
    result = tree.revoke("d")
    assert result.num_tokens_lost == 0 and tree.tier_size(HOST) == 12
    assert [s.tier for s in tree.match(key, None).loads] == [HOST]
    tree.check_integrity()


def test_a_rescue_that_cannot_place_one_prefix_still_places_the_others():
    """Host room for the small prefix but not the big one: the big one is lost (and counted),
    the small one moves to host."""
    from array import array

    from radix_ext import DONOR, HOST, RadixTree, TreeConfig, admission

    tree = RadixTree(TreeConfig(page_size=1, donor=True, host_capacity=8, cascade="off"))
    tree.donor.add_lease("d", 0, 1, 64)
    big, small = array("q", range(100, 120)), array("q", range(200, 204))
    tree.insert(big, array("q", range(20)), None)
    tree.insert(small, array("q", range(20, 24)), None)
    plan = tree.evict_device(24)
    admission.settle(tree, plan.stores, [True] * len(plan.stores))
    assert tree.tier_size(DONOR) == 24
    result = tree.revoke("d", rescue=True)
    assert result.num_tokens_lost == 20 and [list(p.tokens) for p in result.lost_paths] == \
        [list(big)]
    assert [len(t.dst.indices) for t in result.moved] == [4]
    assert [s.tier for s in tree.match(small, None).loads] == [HOST]
    tree.check_integrity()


def test_cascade_down_drops_a_donor_copy_older_than_every_host_copy_and_names_it():
    """Lease and host full (a in donor, b newer in host): c's demotion pushes a out of the lease;
    host keeps b (dropping it for an older copy would lose the newer one), so a is dropped and
    the plan names it (its tokens and donor blocks) for a tier below the tree; nothing moves."""
    from array import array

    from radix_ext import DONOR, HOST, RadixTree, TreeConfig, admission

    tree = RadixTree(TreeConfig(page_size=1, donor=True, host_capacity=8, cascade="down",
                                name_donor_drops=True))
    tree.donor.add_lease("d", 0, 1, 8)
    keys = [array("q", range(base, base + 8)) for base in (100, 200, 300)]
    for i, key in enumerate(keys):
        tree.insert(key, array("q", range(8 * i, 8 * i + 8)), None)
        plan = tree.evict_device(8)
        admission.settle(tree, plan.stores, [True] * len(plan.stores))
    assert not any(type(s).__name__ == "Transfer" for s in plan.steps)
    (drop,) = plan.dropped_donor
    assert list(drop.tokens) == list(keys[0]) and drop.start == 0 and len(drop.src.blocks) == 8
    assert tree.match(keys[0], None).prefix_len == 0
    assert [s.tier for s in tree.match(keys[1], None).loads] == [HOST]
    assert [s.tier for s in tree.match(keys[2], None).loads] == [DONOR]
    tree.check_integrity()


def test_a_cascade_the_tree_does_not_know_is_refused_by_name():
    from radix_ext import TreeConfig

    with pytest.raises(ValueError, match="cascade='sideways' is unknown"):
        TreeConfig(cascade="sideways")
