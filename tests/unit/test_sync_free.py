"""Nothing on the scheduler's steady-state path makes the host wait for a GPU.

The tensors SGLang hands SwiftCache on a GPU (slot indices from its allocator and
`req_to_token`, a forward's `out_cache_loc`, `req_pool_indices` and `seq_lens`, the KV buffers)
are marked as device tensors (`benchmarks/instruments/sync_probe.py`), and every operation that
would synchronise a GPU (reading their values, a blocking copy either way, an op whose output
size depends on them) is counted on the scheduler's thread, for three servers:

- no donation: match, lock, prefix indices, evict, insert, free of SGLang's request flow;
- a borrower whose requests hit the donor tier every step: the same flow plus
  `init_load_back`, the batch start, the streaming settle and the demotions' stores;
- the layer stream cache: one forward's bookkeeping (`begin_layer_stream`, each layer's
  getters and `set_kv_buffer`, `end_layer_stream`).

After a warm-up, each counted step must have zero, or only the operations named in `ALLOWED`,
each at most once (docs/integration.md, "Host-device synchronisation", says why). The copy
kernels themselves run with counting off (`probe.device_side`): on a GPU they are kernel
launches; their CPU references read indices because the CPU is the device there.
"""

from __future__ import annotations

import contextlib
import inspect
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import swift_kernels
from benchmarks.instruments.sync_probe import SyncProbe, device, is_device
from sglang_swift.dataplane import EmulatedDevice, LeasePacking, PoolTransferEngine, pool_transfer
from sglang_swift.dataplane.streams import CpuLane, DeviceLane
from sglang_swift.integration import copies
from sglang_swift.layer_stream import slots as layer_slots
from tests.unit.test_packing import pool_of
from tests.unit.test_streaming import DONOR_PAGE, G, Runtime

STEPS = 12  # counted steps, after WARMUP
WARMUP = 8


def _site_of(module, marker: str) -> str:
    """The probe's name for the line of `module` that holds `marker`."""
    lines = inspect.getsource(module).splitlines()
    line = next(n for n, text in enumerate(lines, 1) if marker in text)
    return f"{Path(module.__file__).parent.name}/{Path(module.__file__).name}:{line}"


# Operations that cannot be avoided on the steady-state path, by what the probe names them, with
# the reason (docs/integration.md, "Host-device synchronisation"); each at most once per step.
FORWARD_SLOTS = _site_of(layer_slots, "the forward's one synchronisation")
SETTLE_WAIT = _site_of(copies, "the settle's one wait").split("/")[-1]
ALLOWED: dict[str, str] = {
    f"d2h to at {FORWARD_SLOTS}": (
        "the layer stream copies each layer's rows as host-issued runs of slots, and the slots "
        "a forward reads and writes exist only in device memory (req_to_token, out_cache_loc): "
        "they come to the host in one copy when the forward begins"),
    f"wait Event.synchronize at {SETTLE_WAIT} (confirm)": (
        "a batch with donor hits settles after its forward was enqueued, and the bytes a load "
        "read are judged (donor alive, lease epoch, blocks not fenced) only once its copy has "
        "finished, before the output is used: when the copy still runs, the host waits for it "
        "(the forward's attention waited for every layer's copy, so this is at most the time "
        "until the forward's own output, which SGLang waits for next)"),
}


@pytest.fixture
def probe(monkeypatch):
    """A SyncProbe active for the whole test; the row-copy kernel runs device-side."""
    p = SyncProbe()
    kernel = swift_kernels.copy_rows

    def on_device(*args, **kwargs):
        with p.device_side():
            return kernel(*args, **kwargs)

    monkeypatch.setattr(pool_transfer.sk, "copy_rows", on_device)
    with p:
        yield p


def _counted_steps(probe: SyncProbe, step) -> list[dict[str, int]]:
    """Run WARMUP uncounted steps, then STEPS counted ones; per step, what the probe counted
    (call site -> operations)."""
    for i in range(WARMUP):
        step(i)
    per_step = []
    for i in range(WARMUP, WARMUP + STEPS):
        before = dict(probe.sites)
        with probe.counting():
            step(i)
        per_step.append({s: n - before.get(s, 0) for s, n in probe.sites.items()
                         if n > before.get(s, 0)})
    return per_step


def _allowed(site: str) -> bool:
    return site in ALLOWED


def _assert_sync_free(per_step: list[dict[str, int]]) -> None:
    """No step has an operation outside ALLOWED, nor one of ALLOWED more than once."""
    bad = [{s: n for s, n in step.items() if not _allowed(s) or n > 1} for step in per_step]
    total = sum(sum(b.values()) for b in bad)
    seen: dict[str, int] = {}
    for b in bad:
        for s, n in b.items():
            seen[s] = seen.get(s, 0) + n
    assert total == 0, (
        f"{total / len(per_step):.1f} host-device synchronisations per step "
        f"({[sum(b.values()) for b in bad]}): "
        + "; ".join(f"{n} x {s}" for s, n in sorted(seen.items())))


# ---- SGLang's side of the request flow ---------------------------------------------------------
def _keys():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return EvictParams, InsertParams, MatchPrefixParams, RadixKey


def _allocator(size: int, kv_pool=None):
    """SGLang's own token allocator; built under the probe, its free pages are device tensors."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    alloc = TokenToKVPoolAllocator(size, torch.int64, "cpu", kv_pool, need_sort=False)
    assert is_device(alloc.free_pages)
    return alloc


def _request_turn(cache, alloc, tokens, rid, *, admit=None):
    """One request through SGLang's scheduler as it calls the cache: match, lock, (the
    PrefillAdder's load-back), prefix indices and slots for the new tokens (prepare_for_extend),
    (batch start, forward, settle), insert, free the duplicates, unlock. `admit(req, match)`
    stands for the load-back; it returns what runs once the batch is built, or None."""
    EvictParams, InsertParams, MatchPrefixParams, RadixKey = _keys()
    key = RadixKey(array("q", tokens))
    m = cache.match_prefix(MatchPrefixParams(key=key))
    req = SimpleNamespace(rid=rid, last_node=m.last_device_node, prefix_len=m.device_prefix_len,
                          full_untruncated_fill_ids=list(tokens), skip_radix_cache_insert=False,
                          discard_output_reason=None)
    cache.inc_lock_ref(req.last_node)
    run = admit(req, m) if admit is not None else None
    prefix = cache.prefix_device_indices(req)
    need = len(tokens) - req.prefix_len
    if alloc.available_size() < need:
        cache.evict(EvictParams(num_tokens=need - alloc.available_size()))
    new = alloc.alloc(need)
    assert new is not None, "no room for the request's new tokens"
    kv = torch.cat([prefix, new])  # the request's req_to_token row
    if run is not None:
        run()
    cache.dec_lock_ref(req.last_node)
    if req.skip_radix_cache_insert:
        alloc.free(kv)
        return req
    r = cache.insert(InsertParams(key=key, value=kv))
    if r.prefix_len > req.prefix_len:
        alloc.free(kv[req.prefix_len:r.prefix_len])  # duplicates of what the tree holds
    return req


def _conversations(n: int, length: int, base: int = 1000):
    """Per conversation, a history of `length` distinct token ids (it grows as it is used)."""
    return [[base * (c + 1) + t for t in range(length)] for c in range(n)]


# ---- 1. no donation ----------------------------------------------------------------------------
def test_a_server_without_donation_never_waits_for_the_gpu(probe):
    """Invariant: SGLang's request flow through SwiftRadixCache without donation (match, lock,
    prefix indices, evictions, insert, free, unlock) performs no host-device synchronisation
    per step once warm; every step hits the cache and evicts."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from radix_ext import TreeConfig
    from sglang_swift.integration.build import build_cache

    alloc = _allocator(96)
    cache = build_cache(
        CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                        page_size=1), TreeConfig(page_size=1))
    shared = list(range(1, 17))  # a system prompt every request starts with
    hits, evicted = [], []

    def step(i):
        tokens = shared + [10_000 + 16 * i + t for t in range(12)]  # 12 new tokens a step
        before = alloc.available_size()
        req = _request_turn(cache, alloc, tokens, f"r{i}")
        hits.append(req.prefix_len)
        evicted.append(before < 12)

    per_step = _counted_steps(probe, step)
    _assert_sync_free(per_step)
    assert all(h == len(shared) for h in hits[WARMUP:]), f"every step hits the cache: {hits}"
    assert all(evicted[WARMUP:]), f"every counted step evicts: {evicted}"
    cache.check_integrity()


# ---- 2. a borrower with donor hits -------------------------------------------------------------
class Borrower:
    """A borrower's SwiftRadixCache over SGLang's allocator, with one donor lease whose pages
    and the borrower's KV buffers are device tensors; its requests come back after their
    prefixes were demoted, so each one is a donor hit loaded under its forward."""

    ROWS = 80

    def __init__(self, pages: int = 256, lane: str = "cpu"):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        from radix_ext import TreeConfig
        from sglang_swift.integration.build import build_cache
        from sglang_swift.integration.cache import STREAM_STATS

        self.k = [device(torch.zeros(self.ROWS + 1, G.num_kv_heads, G.head_dim))
                  for _ in range(G.num_layers)]
        self.v = [device(torch.zeros(self.ROWS + 1, G.num_kv_heads, G.head_dim))
                  for _ in range(G.num_layers)]
        registered = []
        pool = SimpleNamespace(k_buffer=self.k, v_buffer=self.v, layer_num=G.num_layers,
                               register_layer_transfer_counter=registered.append)
        self.alloc = _allocator(self.ROWS, pool)
        self.runtime = Runtime(STREAM_STATS)
        tp_worker = SimpleNamespace(register_hicache_layer_transfer_counter=registered.append)
        self.cache = build_cache(
            CacheInitParams(disable=False, req_to_token_pool=None,
                            token_to_kv_pool_allocator=self.alloc, page_size=1),
            TreeConfig(page_size=1, donor=True), tp_worker=tp_worker, runtime=self.runtime)
        # "device": a GPU's lane on the emulated device (jobs on this thread, copies later)
        self.dev = EmulatedDevice() if lane == "device" else None
        self.lane = DeviceLane(self.dev) if self.dev is not None else CpuLane()
        layout = pool_of(DONOR_PAGE, pages)
        region = device(torch.zeros(layout.data_bytes, dtype=torch.uint8))
        packing = LeasePacking(G, layout, list(range(pages)))
        self.runtime.engines[("d", 0)] = PoolTransferEngine(packing, region, self.k, self.v,
                                                            lane=self.lane)
        self.cache.tree.donor.add_lease("d", 0, 1, packing.num_blocks)

    def close(self):
        self.lane.close()

    def turn(self, tokens, rid, probe):
        """One request; a donor hit is admitted (`init_load_back`), its batch started, its
        forward run (each layer waited for, as the pool's getters do; not counted: it is the
        model's), and settled."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        cache = self.cache

        def admit(req, m):
            cache.swift_step()
            if m.host_hit_length <= 0:
                return None
            cache.dec_lock_ref(req.last_node)  # SGLang locks after the load-back is admitted
            out = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length,
                                                          req=req))
            cache.inc_lock_ref(req.last_node)
            if out:
                req.prefix_len += out[0]

            def run():  # the batch is built (its rows written), run, and settled
                batch = SimpleNamespace(hicache_consumer_index=-1, reqs=[req])
                cache.swift_batch_built(batch)
                with contextlib.ExitStack() as off:  # the forward: the model's, on the GPU
                    if probe._on:
                        off.enter_context(probe.device_side())
                    counter = cache.donor_hits.counter
                    counter.set_consumer(batch.hicache_consumer_index)
                    for layer in range(G.num_layers):
                        counter.wait_until(layer)
                    counter.set_consumer(-1)
                cache.swift_batch_ran(SimpleNamespace(chunked_req=None), batch)
            return run

        return _request_turn(cache, self.alloc, tokens, rid, admit=admit)


@pytest.mark.parametrize("lane", ["cpu", "device"])
def test_a_borrower_whose_requests_hit_the_donor_tier_never_waits_for_the_gpu(probe, lane):
    """Invariant: a borrower whose every request is a donor hit (match reporting it,
    `init_load_back` allocating and queuing, the batch start beginning the copies, the settle
    judging them, the insert adopting the slots, the evictions storing into donor pages)
    performs no host-device synchronisation per step once warm but the ones named in ALLOWED.
    With the "device" lane (a GPU's, on the emulated device) the lane's jobs run on the
    scheduler thread and are counted too, and so is every event or stream synchronize."""
    rig = Borrower(lane=lane)
    if rig.dev is not None:
        probe.attach(rig.dev)
    try:
        # six conversations of 20+ tokens take turns over 80 device rows: when one comes back,
        # the other five have pushed its history into the donor tier (LRU), so its turn loads it
        convs = _conversations(6, 20)
        stats = rig.runtime.stats
        loaded = []

        def step(i):
            c = convs[i % len(convs)]
            c.extend(c[-1] + 1 + t for t in range(2))
            before = stats["loaded_tokens"]
            rig.turn(c, f"r{i}", probe)
            loaded.append(stats["loaded_tokens"] - before)

        per_step = _counted_steps(probe, step)
        _assert_sync_free(per_step)
        assert all(n > 0 for n in loaded[WARMUP:]), f"every counted step is a donor hit: {loaded}"
        assert stats["loads_failed"] == 0 and stats["stored_tokens"] > 0
        rig.lane.submit(lambda: None).result()
        rig.cache.swift_step()
        rig.cache.check_integrity()
    finally:
        rig.close()


# ---- 3. the layer stream cache -----------------------------------------------------------------
def _layer_stream_forwards(probe: SyncProbe):
    """Prefill and decode forwards of a streamed pool (host tier), its staging buffers, KV
    writes and SGLang's allocator and `req_to_token` on the device; (per step counts, pool)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_swift.layer_stream.pool import LayerStreamKVPool, StreamSettings

    layers, size = 4, 256
    pool = LayerStreamKVPool.configured(StreamSettings(depth=2))(
        size=size, page_size=1, dtype=torch.float32, head_num=2, head_dim=4, layer_num=layers,
        device="cpu", enable_memory_saver=False)
    pool._stages = [device(s) for s in pool._stages]  # local memory: on the GPU
    pool._layer_bufs = [device(b) for b in pool._layer_bufs]
    pool.k_buffer = [device(b[0, :size + 1]) for b in pool._layer_bufs]
    pool.v_buffer = [device(b[1, :size + 1]) for b in pool._layer_bufs]
    req_to_token = device(torch.zeros((8, 64), dtype=torch.int32))
    alloc = _allocator(size)
    rows = [0, 1, 2]
    lens = {r: 0 for r in rows}
    last = {}  # layer -> (loc, k, v) of the latest forward

    def step(i):
        decode = i % 3 != 0
        news = {r: 1 if decode else 6 for r in rows}
        if not decode:
            for r in rows:
                lens[r] = 0 if lens[r] > 40 else lens[r]
        prefix = [lens[r] for r in rows]
        with probe.device_side():  # SGLang's scheduler: slots for the new tokens, on the device
            loc = alloc.alloc(sum(news.values()))
            at = 0
            for r, p in zip(rows, prefix):
                req_to_token[r, p:p + news[r]] = loc[at:at + news[r]].to(torch.int32)
                at += news[r]
                lens[r] = p + news[r]
        seq = [lens[r] for r in rows]
        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            req_pool_indices=device(torch.tensor(rows)), seq_lens=device(torch.tensor(seq)),
            seq_lens_cpu=torch.tensor(seq), out_cache_loc=loc,
            extend_prefix_lens_cpu=None if decode else list(prefix))
        pool.begin_layer_stream(batch, req_to_token)
        try:
            for layer_id in range(layers):
                n = loc.numel()
                k = device(torch.randn(n, 2, 4))
                v = device(torch.randn(n, 2, 4))
                pool.set_kv_buffer(SimpleNamespace(layer_id=layer_id), loc, k, v)
                pool.get_key_buffer(layer_id)
                pool.get_value_buffer(layer_id)
                last[layer_id] = (loc, k, v)
        finally:
            pool.end_layer_stream()

    per_step = _counted_steps(probe, step)
    top = layers - 1  # still staged: every row its last forward read or wrote is the store's
    seen = torch.cat([req_to_token[r, :lens[r]] for r in rows]).long()
    assert torch.equal(pool.get_key_buffer(top)[seen], pool.layer_store.data[top, 0, seen])
    for layer_id, (loc, k, v) in last.items():  # written through, at the slots copied at begin
        store = pool.layer_store.data[layer_id]
        assert torch.equal(store[0, loc], k) and torch.equal(store[1, loc], v)
    return per_step, pool


def test_the_layer_stream_cache_bookkeeping_never_waits_for_the_gpu(probe):
    """Invariant: one forward of a streamed pool (its slot sets, each layer's loads, getters and
    write-through) waits for the GPU once, for the copy of its slots named in ALLOWED, and for
    nothing else, in prefill and decode batches."""
    per_step, pool = _layer_stream_forwards(probe)
    _assert_sync_free(per_step)
    assert all(per_step), "the forward's one copy of its slots is counted (the probe sees it)"
    assert pool.stream_stats()["rows_loaded"] > 0 and pool.stream_stats()["rows_saved"] > 0


def test_reading_the_batch_rows_on_the_host_is_caught(probe, monkeypatch):
    """Invariant: the layer stream check fails, naming the line, if the forward's slots are
    gathered from rows read on the host (`req_pool_indices.tolist()`), as they once were."""
    def read_index(forward_batch, req_to_token, lengths):
        rows = forward_batch.req_pool_indices.tolist()
        return torch.cat([req_to_token[r, :n] for r, n in zip(rows, lengths)])

    monkeypatch.setattr(layer_slots, "read_index", read_index)
    per_step, _ = _layer_stream_forwards(probe)
    with pytest.raises(AssertionError, match=r"read tolist at unit/test_sync_free\.py"):
        _assert_sync_free(per_step)


# ---- the probe itself --------------------------------------------------------------------------
def test_the_probe_counts_what_would_synchronise_a_gpu():
    """Invariant: the probe sees each kind of synchronisation (so a zero above means none
    happened) and nothing else: views, cats, arithmetic and asynchronous copies are free."""
    with SyncProbe() as p:
        d = device(torch.arange(10))
        with p.counting():
            free = torch.cat([d[2:5], d * 2 + 1])
            free = free.to(torch.int32)
            host = torch.tensor([1, 2]).to("cpu", non_blocking=True)
            free = torch.cat([free, host.to(torch.int32)])
            assert len(free) == 15 and is_device(free) and p.total() == 0
            d.tolist()
            int(d[0])
            d.to("cpu")
            torch.unique(d)
            torch.cat([d, torch.tensor([1, 2])])
            array("q").frombytes(d.numpy().tobytes()) if False else None
    assert dict(p.counts) == {"read": 2, "d2h": 1, "shape": 1, "h2d": 1}, dict(p.counts)
