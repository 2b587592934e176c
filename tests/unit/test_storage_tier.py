"""L3 below SwiftCache's host tier: SGLang's storage backends as HiCache drives them
(integration/storage_tier.py, integration/storage_hits.py).

Invariants: a prefix that reaches the host tier is written to storage under the keys stock
HiCache uses for the same tokens, so a second server (here: a fresh tree) fetches it from
storage into host memory before admission and loads it back bit for bit; host slots a write
still reads are never handed out; a backend that fails (cannot start, or raises on every write
or read) leaves the server serving with the tiers above it and never yields wrong KV.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from tests.unit.test_host_tier import LAYERS, _device_pool

PAGE = 4


@pytest.fixture(autouse=True)
def _one_rank():
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                 attn_dcp_rank=0):
        yield


def _server_args(path, backend="file", policy="wait_complete"):
    return SimpleNamespace(hicache_storage_backend=backend,
                           hicache_storage_prefetch_policy=policy,
                           hicache_storage_backend_extra_config=(
                               '{"file_storage_path": "%s", "prefetch_threshold": 4}' % path),
                           file_storage_path=None)


class L3Rig:
    """A SwiftRadixCache with a host tier and L3 storage, no control channel."""

    def __init__(self, path, policy="wait_complete", backend="file", spill=0):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        from sglang_swift.config import SwiftConfig
        from sglang_swift.integration.build import build_cache
        from sglang_swift.integration.host_tier import HostKV
        from sglang_swift.integration.storage_tier import StorageTier

        self.pool, self.alloc = _device_pool()
        self.host = HostKV(self.pool, ratio=2.0, size_gb=0, layout="layer_first",
                           io_backend="kernel", page_size=PAGE)
        self.storage = StorageTier.build(self.host, _server_args(path, backend, policy),
                                         page_size=PAGE, model_name="tiny")
        if spill:
            self.host.reserve_spill(spill)
        config = SwiftConfig(enabled=True, host_tier=True)
        tp_worker = SimpleNamespace(register_hicache_layer_transfer_counter=lambda c: None)
        self.cache = build_cache(
            CacheInitParams(disable=False, req_to_token_pool=None,
                            token_to_kv_pool_allocator=self.alloc, page_size=PAGE),
            config.tree_config(PAGE, self.host.capacity), config, tp_worker=tp_worker,
            host_kv=self.host, storage=self.storage)

    def insert(self, tokens):
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        slots = self.alloc.alloc(len(tokens))
        t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
        for layer in range(LAYERS):  # each token's KV names the token and the layer
            self.pool.k_buffer[layer][slots] = t * 10 + layer
            self.pool.v_buffer[layer][slots] = -(t * 10 + layer)
        self.cache.insert(InsertParams(key=RadixKey(list(tokens)), value=slots))

    def evict_all(self):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size()))

    def settle(self):
        """Wait for the I/O threads, then let the tree take what they finished."""
        self.storage.drain()
        self.cache.swift_step(None)

    def fetch(self, tokens, rid="r"):
        """The scheduler's L3 calls for a new request, until it may be admitted."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        handle = CacheRequestHandle(rid, 0)
        self.cache.prefetch_from_storage(handle, self.cache.root_node, list(tokens),
                                         matched_prefix_tokens=[])
        for _ in range(200):
            if self.cache.check_prefetch_progress(handle):
                return self.cache.pop_prefetch_loaded_tokens(handle)
            self.storage.drain()
        raise AssertionError("the prefetch never ended")

    def load(self, tokens):
        """Admit `tokens` + one new token and run its loads: the request's prefix slots."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens) + [1])))
        req = SimpleNamespace(rid="r", last_node=m.last_device_node,
                              prefix_len=m.device_prefix_len,
                              full_untruncated_fill_ids=list(tokens) + [1],
                              skip_radix_cache_insert=False, discard_output_reason=None)
        out = self.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length,
                                                           req=req))
        req.prefix_len += out[0]
        slots = self.cache.prefix_device_indices(req)  # what prepare_for_extend writes
        batch = SimpleNamespace(hicache_consumer_index=-1)
        self.cache.swift_batch_built(batch)
        counter = self.cache.donor_hits.counter
        counter.set_consumer(batch.hicache_consumer_index)
        assert all(counter.wait_until(layer) for layer in range(LAYERS))
        counter.set_consumer(-1)
        self.cache.swift_batch_ran(SimpleNamespace(chunked_req=None), batch)
        assert req.discard_output_reason is None
        return m, slots

    def kv_is(self, slots, tokens) -> bool:
        want = torch.tensor(tokens, dtype=torch.float32)
        return all(torch.equal(self.pool.k_buffer[layer][slots][:, 0, 0], want * 10 + layer)
                   and torch.equal(self.pool.v_buffer[layer][slots][:, 0, 0],
                                   -(want * 10 + layer))
                   for layer in range(LAYERS))


def _stock_keys(tokens):
    """HiCache's page keys for `tokens`: one hash per page, each chained on the one before."""
    from sglang.srt.mem_cache.utils import get_hash_str

    keys, prior = [], None
    for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        prior = get_hash_str(tokens[i:i + PAGE], prior)
        keys.append(prior)
    return keys


def test_a_prefix_in_host_is_written_under_stock_keys_and_a_fresh_tree_fetches_it(tmp_path):
    from radix_ext import HOST

    tokens = list(range(100, 124))
    a = L3Rig(tmp_path)
    a.insert(tokens)
    a.evict_all()  # write_back: the device victims go to host, host writes them to L3
    a.settle()
    assert a.cache.stats["l3_written_pages"] == len(tokens) // PAGE
    assert all(a.storage.backend.exists(k) for k in _stock_keys(tokens))
    a.cache.check_integrity()

    b = L3Rig(tmp_path)  # another server of the same model, sharing the store
    assert b.fetch(tokens + [7]) == len(tokens)
    assert b.cache.tree.tier_size(HOST) == len(tokens)
    for buf in b.pool.k_buffer + b.pool.v_buffer:
        buf.fill_(7777.0)
    m, slots = b.load(tokens)
    assert m.device_prefix_len == 0 and m.host_hit_length == len(tokens)
    assert b.kv_is(slots, tokens)
    assert b.cache.stats["l3_fetched_tokens"] == len(tokens)
    b.cache.swift_step(None)
    b.cache.check_integrity()


def test_a_reclaims_rows_without_host_room_go_to_l3_and_a_fresh_tree_loads_them(tmp_path):
    """A reclaim's donor copy the host tier had no room for (`Unrescued`): its staged rows go
    to storage through the spill slots, two pages per write here, under the keys of its whole
    path; a second server fetches the path (its first two pages written from host as usual)
    and loads it bit for bit. The spill slots are outside the tier's capacity."""
    from array import array

    from radix_ext import Unrescued
    from radix_ext.residency import DonorResidency
    from sglang_swift.dataplane.reclaim_staging import Staged

    tokens = list(range(300, 324))
    a = L3Rig(tmp_path, spill=2 * PAGE)
    assert a.host.capacity + 2 * PAGE == a.host.pool.size
    assert a.cache.tree.host.capacity_tokens() == a.host.capacity
    a.insert(tokens[:8])
    a.evict_all()
    a.settle()
    own = tokens[8:]  # four pages in blocks 5, 6, 7, 8 of a lease, staged as one part
    shape = a.pool.k_buffer[0].shape[1:]
    t = torch.tensor(own, dtype=torch.float32).reshape(-1, *([1] * len(shape)))
    part = Staged([5, 6, 7, 8], [(t * 10 + layer).expand(-1, *shape).clone()
                                 for layer in range(LAYERS)],
                  [(-(t * 10 + layer)).expand(-1, *shape).clone() for layer in range(LAYERS)])
    rows = {b: (part, i) for i, b in enumerate(part.blocks)}
    u = Unrescued(None, array("q", tokens), 8, DonorResidency("d", 0, 1, array("q", [5, 6, 7, 8])))
    assert a.cache.storage_hits.spill([u], rows, PAGE) == len(own)
    assert all(a.storage.backend.exists(k) for k in _stock_keys(tokens))
    assert a.cache.storage_hits.spill([u], rows, PAGE) == 0  # written once

    b = L3Rig(tmp_path)
    assert b.fetch(tokens + [7]) == len(tokens)
    for buf in b.pool.k_buffer + b.pool.v_buffer:
        buf.fill_(7777.0)
    m, slots = b.load(tokens)
    assert m.host_hit_length == len(tokens) and b.kv_is(slots, tokens)


def test_a_fetch_continues_the_prefix_the_tree_holds(tmp_path):
    tokens = list(range(200, 232))
    a = L3Rig(tmp_path)
    a.insert(tokens)
    a.evict_all()
    a.settle()
    b = L3Rig(tmp_path)
    b.insert(tokens[:8])  # the first two pages are on b's device already
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

    handle = CacheRequestHandle("r2", 0)
    b.cache.prefetch_from_storage(handle, b.cache.root_node, tokens[8:] + [5],
                                  matched_prefix_tokens=tokens[:8])
    while not b.cache.check_prefetch_progress(handle):
        b.storage.drain()
    assert b.cache.pop_prefetch_loaded_tokens(handle) == len(tokens) - 8
    m, slots = b.load(tokens)
    assert m.device_prefix_len == 8 and m.host_hit_length == len(tokens) - 8
    assert b.kv_is(slots, tokens)
    b.cache.check_integrity()


def test_host_slots_a_write_still_reads_are_not_handed_out(tmp_path):
    from radix_ext import HOST

    a = L3Rig(tmp_path)
    gate = threading.Event()
    real = a.storage.pages.set
    a.storage.pages.set = lambda keys, host: gate.wait(10) and real(keys, host)
    tokens = list(range(300, 316))
    a.insert(tokens)
    a.evict_all()
    host = a.cache.tree.host
    free_before = host.available_tokens()
    a.cache.tree.make_room(HOST, host.capacity_tokens())  # drop every host copy
    assert a.cache.tree.match(tokens).prefix_len == 0
    assert host.available_tokens() == free_before  # the written pages stay out of reach
    gate.set()
    a.settle()
    assert host.available_tokens() == host.capacity_tokens()
    assert a.cache.stats["l3_written_pages"] == len(tokens) // PAGE
    a.cache.check_integrity()


def test_a_backend_that_cannot_start_leaves_the_server_without_l3(tmp_path, caplog):
    from sglang_swift.integration.host_tier import HostKV
    from sglang_swift.integration.storage_tier import StorageTier

    pool, _ = _device_pool()
    host = HostKV(pool, ratio=2.0, size_gb=0, layout="layer_first", io_backend="kernel",
                  page_size=PAGE)
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with caplog.at_level("ERROR"):
        tier = StorageTier.build(host, _server_args(blocked / "store"), page_size=PAGE,
                                 model_name="tiny")
    assert tier is None
    assert "storage backend 'file' could not start" in caplog.text


def test_a_backend_that_raises_costs_only_its_pages(tmp_path):
    tokens = list(range(400, 424))
    a = L3Rig(tmp_path)

    def broken(*args, **kwargs):
        raise OSError("disk gone")

    a.storage.pages.set = broken
    a.insert(tokens)
    a.evict_all()
    a.settle()
    assert a.cache.stats["l3_written_pages"] == 0 and a.cache.stats["l3_failures"] >= 1
    m, slots = a.load(tokens)  # host still serves it
    assert m.host_hit_length == len(tokens) and a.kv_is(slots, tokens)

    b = L3Rig(tmp_path)
    b.storage.pages.get = broken
    b.storage.pages.hit_query = lambda op: (_stock_keys(tokens), len(tokens))  # claims a hit
    assert b.fetch(tokens + [7]) == 0  # the read failed: nothing joins the tree
    assert b.cache.tree.tier_size("host") == 0
    b.cache.check_integrity()
