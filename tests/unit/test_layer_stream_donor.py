"""The donor store: a streamed pool whose rows live in pages of another model's KV pool (in shared
memory, mapped as a borrower maps it), written through to host memory. Whatever happens to the
donor (pages reclaimed mid-forward, the donor found dead, a new lease later), attention reads
exactly what SGLang's own pool reads, and reads of placed pages come from the donor's memory.
Uses SGLang's real MHATokenToKVPool on CPU as the reference (`Twin` of test_layer_stream)."""

from __future__ import annotations

import threading

import pytest
import torch

from sglang_swift.dataplane import KVGeometry, SharedArena
from sglang_swift.dataplane.packing import LeasePacking
from sglang_swift.dataplane.pool_lease import map_pool
from swift_kernels import K, V
from tests.unit.test_layer_stream import LAYERS, Twin, _streamed
from tests.unit.test_packing import pool_of
from tests.unit.test_pool_transfer import POISON, stream_of

DONOR_PAGE = KVGeometry(3, 1, 8, 8, "float32", 1)  # another model: 192 B per page, ours is 256


class Donor:
    """A donor's pool region in shared memory (poisoned), mapped from its descriptor."""

    def __init__(self, pages: int = 160):
        self.layout = pool_of(DONOR_PAGE, pages)
        self.arena = SharedArena(-(-self.layout.data_bytes // 512) * 512)
        self.arena.memory.view(-1).fill_(POISON)
        self.mapped = map_pool({**self.arena.export(), "layout": self.layout.to_dict()})
        self.up = True  # False: the donor is dead (or past its read deadline)
        self.leases = 0

    def lend(self, store, pages):
        self.leases += 1
        packing = LeasePacking(store.geometry, self.layout, list(pages))
        return store.add_lease(("donor", self.leases), packing, self.mapped.region,
                               lambda: self.up and self.mapped.alive())

    def close(self) -> None:
        self.mapped.close()
        self.arena.close()


@pytest.fixture
def donor():
    d = Donor()
    yield d
    d.close()


def _run(twin: Twin, order: str, at_layer=None) -> None:
    """The forwards of test_layer_stream's twin test; `at_layer` (a callable) runs between
    layers of the decode forward in the middle."""
    twin.forward({0: 10}, order)
    twin.forward({0: 7}, order)
    twin.share_prefix(1, 0, 5)
    twin.forward({1: 6, 0: 1}, order)
    twin.forward({0: 1, 1: 1}, order, between_layers=at_layer)
    twin.forward({0: 1, 1: 1}, order)
    twin.forward({2: 9}, order)
    twin.forward({0: 1, 1: 1, 2: 1}, order)


@pytest.mark.parametrize("order", ["write-first", "read-first"])
@pytest.mark.parametrize("shuffle_slots,max_runs", [(False, 64), (True, 4)])
def test_reclaim_and_dead_donor_mid_forward_leave_every_read_unchanged(donor, order,
                                                                        shuffle_slots, max_runs):
    """Pages of two leases stream from the donor; a reclaim between two layers of a decode
    forward, then the donor found dead in another, flip their pages to host: every read of every
    layer still equals SGLang's pool, reads came from the donor while it held pages, and a
    lease of a donor that reads again is placed again (copied in) and read from once more."""
    twin = Twin(2, max_runs, seed=5, shuffle_slots=shuffle_slots, tier="donor")
    store = twin.streamed.layer_store
    first = donor.lend(store, range(0, 60))  # 45 of the store's 97 pages
    second = donor.lend(store, range(60, 100))  # 30 more; the rest stay host-only
    assert store.place() == 75 and store.pages_on_donor == 75

    def reclaim(layer_id):
        if layer_id == 1:
            assert store.fence(first, range(0, 30)) > 0  # half of the first lease's pages

    _run(twin, order, at_layer=reclaim)
    from_donor = store.rows_from_donor
    assert from_donor > 0 and store.pages_on_donor < 75
    assert int((first.pages == -2).sum()) == 23  # blocks touching 30 of 60 pages of 192 B

    def dies(layer_id):
        if layer_id == 2:
            donor.up = False

    twin.forward({0: 1, 1: 1, 2: 1}, order, between_layers=dies)
    twin.forward({0: 1, 1: 1, 2: 1}, order)
    assert store.pages_on_donor == 0 and store.place() == 0  # dead: nothing placed
    donor.up = True  # it answered again: its blocks that were not reclaimed are refilled
    assert store.place() == first.held + second.held
    before = store.rows_from_donor
    twin.forward({0: 1, 1: 1, 2: 1}, order)
    assert store.rows_from_donor > before


def test_placed_pages_sit_in_donor_memory_as_the_packing_rule_says(donor):
    """After writes through a forward, each placed page's rows of every layer are in the lease's
    byte stream where LeasePacking puts its block (an oracle built from the rule's words), and
    no byte outside the lent pages changed."""
    twin = Twin(2, 64, seed=1, shuffle_slots=False, tier="donor")
    store = twin.streamed.layer_store
    pages = [7, 3, 50, 11, 2, 40, 9, 30, 31, 1, 100, 12]
    lease = donor.lend(store, pages)
    store.place()
    twin.forward({0: 10}, "write-first")
    twin.forward({0: 1}, "write-first")
    g, stream = store.geometry, stream_of(donor.mapped.region, donor.layout, pages)
    placed = [(b, int(p)) for b, p in enumerate(lease.pages.tolist()) if p >= 0]
    assert len(placed) == lease.packing.num_blocks == 9
    for block, page in placed:
        for layer in range(LAYERS):
            for h in (K, V):
                at, size = g.span(layer, h)
                at += block * g.page_bytes
                want = store.data[layer, h, page].reshape(-1).view(torch.uint8)
                assert torch.equal(stream[at: at + size], want), (block, layer, h)
    lent = torch.zeros(donor.mapped.region.numel(), dtype=torch.bool)
    for p in pages:
        for layer in range(DONOR_PAGE.num_layers):
            for h in (K, V):
                off = donor.layout.chunk_offset(p, layer, h)
                lent[off: off + donor.layout.chunk_bytes(h)] = True
    assert bool((donor.mapped.region[~lent] == POISON).all())


def test_a_fence_returns_only_after_the_copy_reading_its_pages(donor):
    """The reclaim may be acknowledged when `fence` returns: a copy reading the lease's pages
    when the fence starts finishes first, and every copy after it reads from host."""
    pool = _streamed(2, tier="donor")
    store = pool.layer_store
    in_copy, release = threading.Event(), threading.Event()
    calls = []

    def readable():
        calls.append(1)
        if len(calls) == 2:  # the copy below, inside the store's lock
            in_copy.set()
            release.wait(10)
        return True

    lease = store.add_lease(("d", 1), LeasePacking(store.geometry, donor.layout, range(40)),
                            donor.mapped.region, readable)
    assert store.place() == 30
    from sglang_swift.layer_stream.slots import SlotSet

    slots = SlotSet.of(torch.arange(1, 20), 64)
    stage = pool._stages[0]
    reader = threading.Thread(target=store.load, args=(0, slots, stage))
    reader.start()
    assert in_copy.wait(10)
    fenced = threading.Event()
    fencer = threading.Thread(target=lambda: (store.fence(lease, range(40)), fenced.set()))
    fencer.start()
    assert not fenced.wait(0.3), "the fence returned while a copy still read the pages"
    release.set()
    reader.join(10)
    assert fenced.wait(10)
    before = store.rows_from_donor
    store.load(0, slots, stage)
    assert store.rows_from_donor == before and store.pages_on_donor == 0
    fencer.join(10)


def test_a_lease_packed_for_another_shape_is_refused(donor):
    """A lease laid out for another model's pages cannot hold this store's."""
    store = _streamed(2, tier="donor").layer_store
    other = KVGeometry(LAYERS, 1, 4, 4, "float32", 1)
    with pytest.raises(ValueError, match="cannot hold this store's pages"):
        store.add_lease(("d", 1), LeasePacking(other, donor.layout, range(4)),
                        donor.mapped.region, lambda: True)


def test_a_streaming_runtime_borrows_for_its_store_and_gives_pages_back_on_reclaim(tmp_path,
                                                                                   monkeypatch):
    """With live control agents and a donor lending pages of its own SGLang pool: the streaming
    server's runtime borrows them for its store (its tree has no donor tier), reads stream from
    them, identical to SGLang's pool; the donor's own traffic reclaims every page, the store
    flips them to host before the acknowledgement, they return to the donor's allocator, and
    reads stay identical."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.plugins import load_plugins

    from radix_ext import RadixTree
    from sglang_swift.config import SwiftConfig
    from sglang_swift.integration.runtime import SwiftRuntime
    from tests.unit.test_runtime import DONOR_SHAPE, _pump_until, _runtime

    load_plugins()  # the hook that puts a lending server's pool in shared memory
    donor = _runtime(tmp_path, monkeypatch, "donor", DONOR_SHAPE, role="donor",
                     lend_fraction=0.5)
    twin = Twin(2, 64, seed=3, shuffle_slots=False, tier="donor")
    config = SwiftConfig(enabled=True, rendezvous_dir=str(tmp_path / "rv"),
                         heartbeat_interval_s=0.05, heartbeat_timeout_s=2.0, layer_stream="donor")
    allocator = TokenToKVPoolAllocator(twin.streamed.size, torch.float32, "cpu", twin.streamed,
                                       need_sort=False)
    streamer = SwiftRuntime(config, model="streamer", kv_pool=twin.streamed, allocator=allocator,
                            tree=RadixTree(config.tree_config(1)), page_size=1,
                            agent_id="streamer")
    store = twin.streamed.layer_store
    donor.start()
    streamer.start()
    try:
        # 32 lent pages of 384 B hold 48 of the store's 256-B pages; the rest stays on host
        _pump_until([donor, streamer], lambda: store.pages_on_donor == 48)
        assert donor.lent_tokens == 32 and streamer.borrowed_tokens() == 48
        assert streamer.tree.donor is None
        _run(twin, "read-first")
        assert store.rows_from_donor > 0
        own = donor.allocator.alloc(donor.allocator.available_size())  # the donor's own burst
        assert own is not None
        _pump_until([donor, streamer], lambda: donor.lent_tokens == 0)
        assert store.pages_on_donor == 0 and streamer.stats["stream_pages_flipped"] == 48
        before = store.rows_from_donor
        twin.forward({0: 1, 1: 1, 2: 1}, "read-first")
        assert store.rows_from_donor == before  # every read from host now, still identical
    finally:
        streamer.stop()
        donor.stop()


def test_bench_context_sizes_the_donor_for_the_store_and_reads_either_pool_line():
    """bench_context's donor lends the whole store (7/16 of its pool lendable at watermark 0.5)
    and the streamed server's pool line is read for both tiers, naming where layers live."""
    from benchmarks.layer_stream import context_bench as cb

    setup = cb.Setup(pool=128, layers=8, depth=2, out_tokens=8, chunk=256, decode_steps=16,
                     repeats=3, backing="donor")
    donor_pool = setup.donor_pool(8 * 1024, 2 * 1024)  # small: 8 KiB per token, tiny: 2 KiB
    assert donor_pool * 7 // 16 >= (setup.streamed_pool + 1) * 4
    for where in ("host memory", "donor memory under a lease, written through to host memory"):
        line = (f"SwiftCache layer streaming: KV pool of 515 tokens; local staging 2 of 8 layers "
                f"(1.0 MiB), every layer in {where} (4.0 MiB)")
        parsed = cb.streamed_pool_log(line)
        assert parsed["store"] == where and parsed["store_mib"] == 4.0


def test_retraction_and_moves_reach_the_donor_blocks_too(donor):
    """Rows SGLang writes on the host side (retraction's load_cpu_copy, move_kv_cache) land in
    the placed pages' blocks as well: a later load, served from donor memory, returns them."""
    from sglang_swift.layer_stream.slots import SlotSet

    pool = _streamed(2, tier="donor")
    store = pool.layer_store
    donor.lend(store, range(130))  # every whole page of the store
    assert store.place() == store.num_pages
    idx = torch.tensor([5, 9, 40])
    saved = [[[torch.randn(3, 2, 4), torch.randn(3, 2, 4)]] for _ in range(LAYERS)]
    pool.load_cpu_copy(saved, idx)
    pool.move_kv_cache(torch.tensor([60, 61]), torch.tensor([5, 9]))
    stage = pool._stages[0]
    for layer in range(LAYERS):
        before = store.rows_from_donor
        store.load(layer, SlotSet.of(torch.tensor([5, 9, 40, 60, 61]), 64), stage)
        assert store.rows_from_donor == before + 5  # all five from donor memory
        k, v = saved[layer][0]
        assert torch.equal(stage[K, [5, 9, 40]], k) and torch.equal(stage[V, [5, 9, 40]], v)
        assert torch.equal(stage[K, [60, 61]], k[:2]) and torch.equal(stage[V, [60, 61]], v[:2])


def test_a_dead_donors_leases_all_leave_the_store_before_its_pool_is_unmapped(donor,
                                                                            monkeypatch):
    """Two leases on one donor's pool; the donor's process dies and one lease is reported lost:
    both leave the store (every page to host) before the mapping is closed and unlinked, so no
    copy can touch unmapped memory, and reads keep returning what was written."""
    import types

    from sglang_swift.control import LeaseGranted, LeaseKey, LeaseLost
    from sglang_swift.control.protocol import MemoryDescriptor
    from sglang_swift.dataplane import borrowing
    from sglang_swift.layer_stream import store_leases
    from sglang_swift.layer_stream.slots import SlotSet

    pool = _streamed(2, tier="donor")
    agent = types.SimpleNamespace(read_deadline=lambda donor, lease=None: float("inf"),
                                  release=lambda key, blocks=None: None,
                                  request=lambda n: None)
    stats = {"leases": 0, "lost_leases": 0}
    leases = store_leases.StoreLeases.for_pool(pool, agent=agent, stats=stats)
    memory = MemoryDescriptor.coerce({**donor.arena.export(), "layout": donor.layout.to_dict()})
    for lease_id, pages in ((1, range(0, 40)), (2, range(40, 80))):
        leases.on_granted(LeaseGranted(lease_id, LeaseKey("d", 7, lease_id), tuple(pages),
                                       memory), None)
    store = leases.store
    assert store.pages_on_donor == 60 and stats["leases"] == 2
    rows = torch.randn(2, 97, 2, 4)
    stage = pool._stages[0]
    stage[:, :97] = rows
    everything = SlotSet.of(torch.arange(97), 64)
    store.save(0, everything, stage)
    unlinked = []
    monkeypatch.setattr(store_leases, "owner_alive", lambda pid: False)
    monkeypatch.setattr(borrowing, "owner_alive", lambda pid: False)
    monkeypatch.setattr(borrowing, "unlink_descriptor", unlinked.append)
    leases.on_lost(LeaseLost(LeaseKey("d", 7, 1), tuple(range(40)), "connection closed"), None)
    assert not leases.leases and not store.leases and store.pages_on_donor == 0
    assert stats["lost_leases"] == 2
    assert not leases._mapped and len(unlinked) == 1
    stage.zero_()
    before = store.rows_from_donor
    store.load(0, everything, stage)
    assert store.rows_from_donor == before and torch.equal(stage[:, :97], rows)
    leases.close()


def test_resident_rows_never_go_to_the_donor():
    """With resident rows, only the streamed pages are the store's to place: the lease holds
    those and no resident page, and every read still equals SGLang's pool."""
    donor = Donor(pages=2000)
    try:
        twin = Twin(2, 64, seed=7, shuffle_slots=False, tier="donor", resident_fraction=0.5,
                    head_dim=64)
        store, resident = twin.streamed.layer_store, twin.streamed.resident_rows
        assert resident > 0 and store.first_page == resident
        assert store.num_pages == 97 - resident
        donor.lend(store, range(0, 2000))
        assert store.place() == store.num_pages
        assert bool((store._owner[:resident] == -1).all())  # FREE: resident pages stay home
        _run(twin, "write-first")
        assert store.rows_from_donor > 0
    finally:
        donor.close()
