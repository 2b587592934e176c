"""Tensor-parallel shards in donor memory (dataplane/packing.py "Shards"): each TP rank of a
borrower stores only its own shard of the KV heads, the ranks' shards of one block sit side by
side in the lent pages, and every rank numbers the lease's blocks alike."""

from __future__ import annotations

import pytest
import torch

from sglang_swift.dataplane import KVGeometry
from sglang_swift.dataplane.layer_counter import CpuLayerCounter
from sglang_swift.dataplane.packing import LeasePacking
from sglang_swift.dataplane.pool_transfer import PoolTransferEngine
from tests.unit.test_packing import PAIRS, pool_of
from tests.unit.test_pool_transfer import POISON, borrower_pool, poisoned_like, same


def _whole(g: KVGeometry, ranks: int) -> KVGeometry:
    return KVGeometry(g.num_layers, g.num_kv_heads * ranks, g.head_dim, g.v_head_dim,
                      g.dtype, g.page_size)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_every_rank_numbers_the_blocks_alike_and_owns_disjoint_bytes(name, ranks):
    """Invariant: a lease holds as many blocks for every rank as an unsharded borrower with all
    the heads would get (same unused tail); rank r's shard of block b is the r-th slice of the
    block's span; reclaimed pages touch the same blocks on every rank."""
    donor_page, g = PAIRS[name]
    layout = pool_of(donor_page, 24)
    pages = list(range(3, 23))
    whole = LeasePacking(_whole(g, ranks), layout, pages)
    shards = [LeasePacking(g, layout, pages, shard=(r, ranks)) for r in range(ranks)]
    for r, p in enumerate(shards):
        assert (p.num_blocks, p.unused_bytes, p.block_bytes) == (
            whole.num_blocks, whole.unused_bytes, whole.block_bytes)
        assert p.shard_offset == r * g.page_bytes
        assert p.blocks_touching([5, 17]) == whole.blocks_touching([5, 17])
    assert LeasePacking.pages_for(g, layout, 7, ranks=ranks) == LeasePacking.pages_for(
        _whole(g, ranks), layout, 7)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_two_ranks_store_into_one_lease_and_load_back_their_own_shards(name):
    """Invariant: two ranks storing the same blocks into one donor region never overwrite each
    other (each writes only its own slice of each block) and each loads back exactly its own
    shard, bit for bit."""
    donor_page, g = PAIRS[name]
    layout = pool_of(donor_page, 24)
    region = torch.full((layout.data_bytes,), POISON, dtype=torch.uint8)
    pages = list(range(2, 22))
    P, rows = g.page_size, 128
    pools, engines = [], []
    for r in range(2):
        packing = LeasePacking(g, layout, pages, shard=(r, 2))
        k, v = borrower_pool(g, rows, seed=10 + r)
        pools.append((k, v))
        engines.append((packing, PoolTransferEngine(packing, region, k, v)))
    n_blocks = engines[0][0].num_blocks
    assert n_blocks >= 1
    blocks = torch.arange(n_blocks)
    slots = torch.arange(n_blocks * P)
    for _, engine in engines:
        assert engine.begin_store(slots, blocks).wait(30).ok
    for r, (packing, _) in enumerate(engines):
        k2, v2 = poisoned_like(pools[r][0]), poisoned_like(pools[r][1])
        loader = PoolTransferEngine(packing, region, k2, v2)
        counter = CpuLayerCounter(g.num_layers, timeout_s=30)
        handle = loader.begin_load(slots, blocks, counter)
        counter.set_consumer(handle.producer_id)
        for layer in range(g.num_layers):
            assert counter.wait_until(layer)
            assert same(k2[layer][slots], pools[r][0][layer][slots])
            assert same(v2[layer][slots], pools[r][1][layer][slots])
        assert handle.wait(30).ok
        loader.close()
    for _, engine in engines:
        engine.close()


def test_a_bad_shard_is_refused_with_the_reason():
    donor_page, g = PAIRS["layers"]
    with pytest.raises(ValueError, match="rank must be in"):
        LeasePacking(g, pool_of(donor_page, 8), [0, 1], shard=(2, 2))
