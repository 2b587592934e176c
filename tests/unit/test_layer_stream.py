"""The layer stream pool reads exactly what SGLang's own pool reads, with depth/L of its local
memory; the plugin sizes, builds and brackets it only when the server streams layers. Uses
SGLang's real MHATokenToKVPool on CPU as the reference."""

from __future__ import annotations

import random
import types

import pytest
import torch

from sglang_swift.layer_stream.slots import SlotSet, batch_read_slots

LAYERS = 4
ARGS = dict(size=96, page_size=1, dtype=torch.float32, head_num=2, head_dim=4, layer_num=LAYERS,
            device="cpu", enable_memory_saver=False)


def _streamed(depth: int, max_runs: int = 64, tier: str = "host", resident_fraction: float = 0.0,
              **args):
    from sglang_swift.layer_stream.pool import LayerStreamKVPool, StreamSettings

    settings = StreamSettings(depth=depth, max_runs=max_runs, tier=tier,
                              resident_fraction=resident_fraction)
    return LayerStreamKVPool.configured(settings)(**{**ARGS, **args})


def _batch(mode: str, rows, seq_lens, prefix_lens):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(
        forward_mode=ForwardMode[mode], req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens), seq_lens_cpu=torch.tensor(seq_lens),
        extend_prefix_lens_cpu=list(prefix_lens) if mode != "DECODE" else None)


class Twin:
    """A stock pool and a streamed one fed the same forwards; every read is compared."""

    def __init__(self, depth: int, max_runs: int, seed: int, shuffle_slots: bool,
                 tier: str = "host", resident_fraction: float = 0.0, head_dim: int = 4):
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        self.head_dim = head_dim
        self.stock = MHATokenToKVPool(**{**ARGS, "head_dim": head_dim})
        self.streamed = _streamed(depth, max_runs, tier, resident_fraction, head_dim=head_dim)
        self.req_to_token = torch.zeros((8, 64), dtype=torch.int32)
        self.free = list(range(1, ARGS["size"] + 1))
        self.rng = random.Random(seed)
        if shuffle_slots:  # fragmented slots: the index path instead of runs
            self.rng.shuffle(self.free)
        self.lens = {}  # row -> tokens it holds

    def share_prefix(self, row: int, src: int, n: int) -> None:
        """Row `row` starts with the first n slots of `src` (a radix-cache hit)."""
        self.req_to_token[row, :n] = self.req_to_token[src, :n]
        self.lens[row] = n

    def forward(self, news: dict[int, int], order: str, between_layers=None) -> None:
        """One forward: each row in `news` appends that many tokens; attention reads every row.
        `between_layers(layer_id)` runs after each layer (faults injected mid-forward)."""
        rows = list(news)
        prefix = [self.lens.get(r, 0) for r in rows]
        locs = []
        for r, p in zip(rows, prefix):
            slots = [self.free.pop(0) for _ in range(news[r])]
            self.req_to_token[r, p:p + news[r]] = torch.tensor(slots, dtype=torch.int32)
            locs += slots
            self.lens[r] = p + news[r]
        loc = torch.tensor(locs)
        mode = "DECODE" if all(n == 1 for n in news.values()) and all(prefix) else "EXTEND"
        batch = _batch(mode, rows, [self.lens[r] for r in rows], prefix)
        self.streamed.begin_layer_stream(batch, self.req_to_token)
        try:
            for layer_id in range(LAYERS):
                layer = types.SimpleNamespace(layer_id=layer_id)
                k = torch.randn(len(locs), 2, self.head_dim)
                v = torch.randn(len(locs), 2, self.head_dim)
                if order == "read-first":  # FlashInfer's ragged prefill reads the prefix first
                    self._compare(layer_id, rows, prefix)
                for pool in (self.stock, self.streamed):
                    pool.set_kv_buffer(layer, loc, k, v)
                self._compare(layer_id, rows, [self.lens[r] for r in rows])
                if between_layers is not None:
                    between_layers(layer_id)
        finally:
            self.streamed.end_layer_stream()

    def _compare(self, layer_id: int, rows, lengths) -> None:
        ks, vs = self.stock.get_kv_buffer(layer_id)
        kt, vt = self.streamed.get_kv_buffer(layer_id)
        for r, n in zip(rows, lengths):
            idx = self.req_to_token[r, :n].long()
            assert torch.equal(ks[idx], kt[idx]) and torch.equal(vs[idx], vt[idx]), \
                f"layer {layer_id}, row {r}: streamed KV differs from the stock pool's"


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("order", ["write-first", "read-first"])
@pytest.mark.parametrize("shuffle_slots,max_runs", [(False, 64), (True, 4)])
@pytest.mark.parametrize("resident_fraction", [0.0, 0.5])
def test_streamed_pool_reads_what_the_stock_pool_reads(depth, order, shuffle_slots, max_runs,
                                                       resident_fraction):
    """Through chunked prefill, a shared prefix, mixed batches and decode, attention on every
    layer reads from the streamed pool exactly the K and V rows it reads from SGLang's pool,
    whichever of write or read a backend does first, with runs or index copies, with every row
    streamed or with resident rows (requests on both sides of the boundary)."""
    twin = Twin(depth, max_runs, seed=depth, shuffle_slots=shuffle_slots,
                resident_fraction=resident_fraction, head_dim=64 if resident_fraction else 4)
    if resident_fraction:
        assert twin.streamed.resident_rows > 0
    twin.forward({0: 10}, order)            # prefill
    twin.forward({0: 7}, order)             # its second chunk (prefix 10)
    twin.share_prefix(1, 0, 5)              # a radix hit on row 0's first 5 tokens
    twin.forward({1: 6, 0: 1}, order)       # extend row 1 beside row 0's next token
    for _ in range(4):
        twin.forward({0: 1, 1: 1}, order)   # decode
    twin.forward({2: 9}, order)
    twin.forward({0: 1, 1: 1, 2: 1}, order)
    assert twin.streamed.stream_stats()["rows_loaded"] > 0


def test_streamed_pool_holds_depth_layers_locally_and_every_layer_in_the_store():
    """Local KV bytes are depth/L of the stock pool's; the store holds L layers; every layer's
    buffer is a view of one of `depth` staging buffers."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    stock = sum(MHATokenToKVPool(**ARGS).get_kv_size_bytes())
    pool = _streamed(2)
    assert sum(pool.get_kv_size_bytes()) * LAYERS == stock * 2
    assert pool.layer_store.nbytes == stock
    ptrs = {pool.k_buffer[layer].data_ptr() for layer in range(LAYERS)}
    assert len(ptrs) == 2


def test_outside_a_forward_getters_touch_nothing():
    """Shape queries at start-up (no forward open) return the staging view and copy nothing."""
    pool = _streamed(2)
    assert pool.get_key_buffer(3).shape == (97, 2, 4)
    assert pool.stream_stats()["rows_loaded"] == 0


def test_cpu_copy_and_move_go_to_the_store():
    """Retraction's CPU copy and move_kv_cache see every layer, not the staging buffers."""
    pool = _streamed(2)
    pool.layer_store.data.copy_(torch.randn_like(pool.layer_store.data))
    idx = torch.tensor([5, 9])
    saved = pool.get_cpu_copy(idx)
    assert torch.equal(saved[3][0][0], pool.layer_store.data[3, 0, idx])
    pool.move_kv_cache(torch.tensor([20, 21]), idx)
    assert torch.equal(pool.layer_store.data[:, :, [20, 21]], pool.layer_store.data[:, :, [5, 9]])
    pool.load_cpu_copy([[[torch.zeros(2, 2, 4), torch.ones(2, 2, 4)]]] * LAYERS, idx)
    assert pool.layer_store.data[:, 1, idx].eq(1).all()
    assert pool.layer_store.data[:, 0, idx].eq(0).all()


def test_depth_not_below_layers_is_refused_naming_the_option():
    """A depth that streams nothing fails at pool creation with the option's name."""
    with pytest.raises(ValueError, match="layer-stream-depth 4"):
        _streamed(4)


def test_slot_sets_are_runs_or_one_index():
    """Slots become sorted disjoint runs, or one unique sorted index past max_runs; both
    cover exactly the distinct slots given."""
    s = SlotSet.of(torch.tensor([7, 3, 4, 5, 8, 4, 20]), max_runs=8)
    assert s.runs == ((3, 6), (7, 9), (20, 21)) and s.count == 6
    assert s.as_index().tolist() == [3, 4, 5, 7, 8, 20]
    f = SlotSet.of(torch.tensor([7, 3, 4, 5, 8, 4, 20]), max_runs=2)
    assert f.runs is None and f.index.tolist() == [3, 4, 5, 7, 8, 20]
    assert SlotSet.of(torch.tensor([], dtype=torch.int64), 4).count == 0


def test_a_batch_reads_its_prefixes_only():
    """Extend reads extend_prefix_lens positions of each row, decode all but the new token,
    idle nothing."""
    r2t = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    ext = batch_read_slots(_batch("EXTEND", [1, 3], [6, 4], [2, 0]), r2t, 8)
    assert ext.as_index().tolist() == [10, 11]
    dec = batch_read_slots(_batch("DECODE", [0, 2], [3, 2], []), r2t, 8)
    assert dec.as_index().tolist() == [0, 1, 20]
    assert batch_read_slots(_batch("IDLE", [], [], []), r2t, 8).count == 0


# ---- resident rows ------------------------------------------------------------------------------
def _resident_pool(**kw):
    return _streamed(2, resident_fraction=0.5, head_dim=64, **kw)  # 512-byte rows: 8 per 4 KiB


def test_resident_rows_are_each_layers_own_and_cost_their_share_of_local_memory():
    """Resident rows of two layers sharing a staging buffer are distinct memory; streamed rows
    are shared; local memory is L x R + depth x (rows - R) rows, R holding the asked fraction."""
    pool = _resident_pool()
    r, rows = pool.resident_rows, pool._layer_bufs[0].shape[1]
    assert r == 32  # f D N / (L (1 - f) + f D) = 0.5 * 2 * 96 / (2 + 1), on a page of 8 rows
    pool.k_buffer[0][:r] = 1.0
    pool.k_buffer[2][:r] = 2.0
    assert pool.k_buffer[0][:r].eq(1).all() and pool.k_buffer[2][:r].eq(2).all()
    pool.k_buffer[0][r:] = 3.0
    assert pool.k_buffer[2][r:].eq(3).all() and pool.k_buffer[1][r:].ne(3).all()
    row_bytes = 2 * 64 * 4
    assert pool.local_kv_bytes() == 2 * row_bytes * (LAYERS * r + 2 * (rows - r))
    f = LAYERS * r / (LAYERS * r + 2 * (rows - r))
    assert abs(f - 0.5) < 0.1


def test_a_batch_on_resident_slots_copies_nothing():
    """A request whose slots are all resident is neither loaded nor written through; one that
    spills past the boundary copies only its streamed rows."""
    twin = Twin(2, 64, seed=0, shuffle_slots=False, resident_fraction=0.5, head_dim=64)
    r = twin.streamed.resident_rows
    twin.forward({0: 10}, "write-first")
    for _ in range(3):
        twin.forward({0: 1}, "write-first")
    stats = twin.streamed.stream_stats()
    assert stats["rows_loaded"] == 0 and stats["rows_saved"] == 0
    twin.forward({1: r + 5}, "write-first")   # slots 14 .. r + 18: 19 of them streamed
    twin.forward({1: 1}, "write-first")
    stats = twin.streamed.stream_stats()
    streamed = 14 + r + 5 - r
    assert stats["rows_saved"] == LAYERS * (streamed + 1)
    assert stats["rows_loaded"] == LAYERS * streamed


def test_host_side_readers_see_both_sides_of_the_boundary():
    """Retraction's CPU copy, its reload and move_kv_cache work on resident and streamed slots."""
    pool = _resident_pool()
    r = pool.resident_rows
    for layer in range(LAYERS):
        pool.k_buffer[layer][:r] = torch.randn(r, 2, 64)
        pool.v_buffer[layer][:r] = torch.randn(r, 2, 64)
    pool.layer_store.data.copy_(torch.randn_like(pool.layer_store.data))
    idx = torch.tensor([3, r + 4])
    saved = pool.get_cpu_copy(idx)
    assert torch.equal(saved[2][0][0][0], pool.k_buffer[2][3])
    assert torch.equal(saved[2][0][1][1], pool.layer_store.data[2, 1, r + 4])
    pool.move_kv_cache(torch.tensor([r + 9, 5]), idx)  # resident -> streamed, streamed -> resident
    assert torch.equal(pool.layer_store.data[1, 0, r + 9], pool.k_buffer[1][3])
    assert torch.equal(pool.k_buffer[1][5], pool.layer_store.data[1, 0, r + 4])
    ones = torch.ones(2, 2, 64)
    pool.load_cpu_copy([[[ones, 2 * ones]]] * LAYERS, idx)
    assert pool.k_buffer[3][3].eq(1).all() and pool.layer_store.data[3, 1, r + 4].eq(2).all()


def test_a_resident_fraction_too_small_to_map_streams_every_row():
    """Resident rows that round to no whole mapping unit: the pool streams every row."""
    pool = _streamed(2, resident_fraction=0.05)  # 32-byte rows: 128 rows per 4 KiB page
    assert pool.resident_rows == 0 and len({b.data_ptr() for b in pool.k_buffer}) == 2


def test_slot_sets_cut_at_the_first_streamed_row():
    runs = SlotSet.of(torch.tensor([2, 3, 4, 9, 10, 30]), max_runs=8)
    assert runs.from_slot(4).runs == ((4, 5), (9, 11), (30, 31)) and runs.from_slot(4).count == 4
    assert runs.from_slot(0) is runs and runs.from_slot(40).count == 0
    index = SlotSet.of(torch.tensor([2, 3, 4, 9, 10, 30]), max_runs=1)
    assert index.from_slot(9).index.tolist() == [9, 10, 30]
    assert index.from_slot(31).count == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_allocator_hands_out_resident_slots_first(page_size):
    """SGLang's own allocator, made resident-first: after frees on both sides, the next request
    gets resident slots while any are free, and the free count stays SGLang's."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from sglang_swift.layer_stream.allocator import prefer_resident

    if page_size == 1:
        alloc = TokenToKVPoolAllocator(64, torch.float32, "cpu", None, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(64, page_size, torch.float32, "cpu", None,
                                            need_sort=False)
    prefer_resident(alloc)
    first = alloc.alloc(40)
    assert first is not None and int(first.max()) < 48
    # SGLang's token allocator appends freed slots, its paged one prepends freed pages: free
    # resident ones, then streamed ones, and either would hand out a streamed slot next.
    alloc.free(first[:8])
    alloc.free(first[20:])
    again = alloc.alloc(8)
    assert int(again.max()) < 16, again
    assert alloc.available_size() == 64 - 40 + 8 + 20 - 8


@pytest.fixture
def emulated_lane(monkeypatch):
    """Streamed pools built inside the test copy on the emulated device: every copy runs later
    than it is issued, on the device's stream thread, as on a GPU's side stream."""
    from sglang_swift.dataplane.emulated import EmulatedDevice
    from sglang_swift.layer_stream import pool as pool_module
    from sglang_swift.layer_stream.store import CopyLane

    device = EmulatedDevice("layer-stream")
    monkeypatch.setattr(pool_module, "CopyLane", lambda _device: CopyLane(device))
    return device


def _slow_saves(pool, delay_s: float) -> None:
    """The pool's write-throughs take `delay_s` each before copying (a slow copy engine)."""
    import time

    store = pool.layer_store
    save = store.save

    def slow(layer, slots, stage):
        time.sleep(delay_s)
        save(layer, slots, stage)

    store.save = slow


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("order", ["write-first", "read-first"])
def test_the_gpu_protocol_on_an_emulated_device_reads_what_the_stock_pool_reads(
        emulated_lane, depth, order):
    """The same forwards as above with every copy completing later than issued (the GPU's
    ordering: markers, the forward waiting on the layer it reads)."""
    twin = Twin(depth, 64, seed=depth, shuffle_slots=False)
    assert twin.streamed._lane.emulated is emulated_lane
    twin.forward({0: 10}, order)
    twin.share_prefix(1, 0, 5)
    twin.forward({1: 6, 0: 1}, order)
    for _ in range(3):
        twin.forward({0: 1, 1: 1}, order)
    assert not emulated_lane.errors


@pytest.mark.parametrize("depth", [2, 3])
def test_a_queued_write_through_reads_its_own_layers_rows(emulated_lane, depth):
    """Copies complete later than they are issued; a prefill that reads nothing streamed waits
    for no load, yet the next layer sharing its staging buffer must not overwrite rows a queued
    write-through has still to copy (else the store keeps the wrong layer's KV and every later
    read of it is wrong)."""
    twin = Twin(depth, 64, seed=1, shuffle_slots=False)
    _slow_saves(twin.streamed, 0.02)
    twin.forward({0: 12}, "write-first")      # nothing read: no load to wait for
    twin.forward({0: 1}, "write-first")       # reads the prefill's rows back from the store
    twin.forward({0: 1}, "read-first")


def test_a_failed_write_through_fails_the_next_wait_not_a_later_read(emulated_lane):
    twin = Twin(2, 64, seed=2, shuffle_slots=False)
    store = twin.streamed.layer_store

    def broken(layer, slots, stage):
        raise OSError("host memory gone")

    store.save = broken
    with pytest.raises(RuntimeError, match="a copy of KV rows failed"):
        twin.forward({0: 8}, "write-first")
