"""The pool lease's exchange (dataplane/pool_transfer.py `begin_exchange` / `exchange_here`).

An exchange swaps borrower tokens `slots` with lease blocks `blocks` (token i with row
i % page_size of block `blocks[i // page_size]`), every layer, K and V. The oracle here is
independent of the engine's unit arithmetic: the lease's byte stream by the rule's words (each
lent page's chunks, layer by layer, K then V, as `stream_of` in test_pool_transfer.py) gives the
region bytes of every token row, and the expected state after a swap is built from a snapshot of
both sides taken just before it. Every check compares the whole borrower pool and the whole
donor region bitwise, so a byte moved where it should not be fails as surely as one not moved.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from sglang_swift.dataplane import CpuLayerCounter
from sglang_swift.dataplane.pool_transfer import FENCED
from swift_kernels import K, V
from tests.unit.test_packing import PAIRS
from tests.unit.test_pool_transfer import (
    POISON,
    Lease,
    borrower_pool,
    poisoned_like,
    same,
    stream_of,
)

BACKENDS = ["reference", "staged"]


def rows_of(buf: torch.Tensor) -> torch.Tensor:
    """A borrower layer buffer as `[rows, row bytes]` uint8 (a view: writes go through)."""
    return buf.view(torch.uint8).reshape(buf.shape[0], -1)


def region_index(lease: Lease) -> torch.Tensor:
    """The region byte offset of each byte of the lease's stream (stream_of's order)."""
    parts = []
    for p in lease.pages:
        for layer in range(lease.layout.geometry.num_layers):
            for h in (K, V):
                off = lease.layout.chunk_offset(p, layer, h)
                parts.append(torch.arange(off, off + lease.layout.chunk_bytes(h)))
    idx = torch.cat(parts)
    assert same(lease.region[idx], stream_of(lease.region, lease.layout, lease.pages))
    return idx


def token_offsets(lease: Lease, idx: torch.Tensor, blocks, n: int, layer: int,
                  h: int) -> torch.Tensor:
    """`[n, row bytes]` region offsets of tokens 0..n-1's layer `layer` K or V rows when they
    sit in lease blocks `blocks` (token i: row i % P of block blocks[i // P])."""
    g = lease.g
    P = g.page_size
    off, count = g.span(layer, h)
    row = count // P
    tok = torch.arange(n)
    at = torch.as_tensor(blocks, dtype=torch.int64)[tok // P] * g.page_bytes + off \
        + tok % P * row
    return idx[at[:, None] + torch.arange(row)]


def snapshot(lease: Lease):
    return ([t.clone() for t in lease.k], [t.clone() for t in lease.v], lease.region.clone())


def swapped_state(lease: Lease, before, slots, blocks, layers):
    """The state `before` with layers `layers` of `slots` and `blocks` swapped, K and V."""
    k0, v0, r0 = before
    k1, v1, r1 = [t.clone() for t in k0], [t.clone() for t in v0], r0.clone()
    idx, n = region_index(lease), len(slots)
    for layer in layers:
        for h, b0, b1 in ((K, k0, k1), (V, v0, v1)):
            ofs = token_offsets(lease, idx, blocks, n, layer, h)
            rows_of(b1[layer])[slots] = r0[ofs]
            r1[ofs] = rows_of(b0[layer])[slots]
    return k1, v1, r1


def assert_state(lease: Lease, want) -> None:
    """The whole borrower pool and the whole donor region are bitwise `want`."""
    k, v, region = want
    for layer in range(lease.g.num_layers):
        assert same(lease.k[layer], k[layer]), ("K", layer)
        assert same(lease.v[layer], v[layer]), ("V", layer)
    moved = (lease.region != region).nonzero().reshape(-1)
    assert moved.numel() == 0, f"{moved.numel()} region bytes differ, first at {moved[:8]}"


def stored(lease: Lease, aligned: bool, seed: int = 0, engine=None):
    """Store tokens X (slots sx) into lease blocks B; returns (sx, sy, B, X) with sy victims
    disjoint from sx (same count, same alignment) and X the K / V rows stored per layer."""
    g, P = lease.g, lease.g.page_size
    nb = min(lease.packing.num_blocks, lease.rows // P // 2)
    n = nb * P - (0 if aligned else P // 2)  # scattered: a partial last page
    blocks = torch.randperm(lease.packing.num_blocks,
                            generator=torch.Generator().manual_seed(seed + 1))[:nb]
    both = lease.slots(2 * nb * P, aligned, seed=seed + 2)
    sx, sy = both[:n], both[nb * P: nb * P + n]
    store = engine or lease.engine()
    assert store.begin_store(sx, blocks).wait(30).ok
    lease.check_stream(sx, blocks)
    X = ([lease.k[layer][sx].clone() for layer in range(g.num_layers)],
         [lease.v[layer][sx].clone() for layer in range(g.num_layers)])
    if engine is None:
        store.close()
    return sx, sy, blocks, X


def lent_mask(lease: Lease) -> torch.Tensor:
    lent = torch.zeros(lease.region.numel(), dtype=torch.bool)
    lent[region_index(lease)] = True
    return lent


def run_exchange(engine, how: str, slots, blocks):
    if how == "here":
        return engine.exchange_here(slots, blocks)
    handle = engine.begin_exchange(slots, blocks)
    result = handle.wait(30)
    assert handle.result() == result
    return result


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["here", "lane"])
@pytest.mark.parametrize("aligned", [True, False], ids=["pages", "scattered"])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_exchange_swaps_slots_and_blocks_bit_for_bit(name, aligned, how, backend):
    """Invariant: for every shape pair, after an exchange the victim slots hold exactly what the
    blocks held (the tokens stored there) and the blocks hold exactly what the victims held,
    every layer, K and V; no other borrower row and no other region byte changes (outside the
    lent pages the poison stays), and a load of the blocks gives back the victims."""
    lease = Lease(name)
    engine = lease.engine(backend=backend)
    assert engine.backend == backend
    sx, sy, blocks, (xk, xv) = stored(lease, aligned, engine=engine)
    before = snapshot(lease)
    victims = ([t[sy].clone() for t in lease.k], [t[sy].clone() for t in lease.v])
    assert not any(same(a, b) for a, b in zip(victims[0], xk)), "victims equal to X prove nothing"

    result = run_exchange(engine, how, sy, blocks)
    assert result.ok and result.failed_layers == () and result.reason is None

    for layer in range(lease.g.num_layers):
        assert same(lease.k[layer][sy], xk[layer]) and same(lease.v[layer][sy], xv[layer]), layer
    idx = region_index(lease)
    for layer in range(lease.g.num_layers):
        for h, vic in ((K, victims[0]), (V, victims[1])):
            ofs = token_offsets(lease, idx, blocks, len(sy), layer, h)
            assert same(lease.region[ofs], rows_of(vic[layer])), (layer, h)
    assert bool((lease.region[~lent_mask(lease)] == POISON).all()), "wrote outside the lease"
    assert_state(lease, swapped_state(lease, before, sy, blocks, range(lease.g.num_layers)))

    # the engine's own load path reads the victims back out of the blocks
    k2, v2 = poisoned_like(lease.k), poisoned_like(lease.v)
    loader = lease.engine(k2, v2, backend=backend)
    counter = CpuLayerCounter(lease.g.num_layers, timeout_s=30)
    assert loader.begin_load(sx, blocks, counter).wait(30).ok
    for layer in range(lease.g.num_layers):
        assert same(k2[layer][sx], victims[0][layer]) and same(v2[layer][sx], victims[1][layer])
    loader.close()
    engine.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("overlap", ["half", "all"])
@pytest.mark.parametrize("aligned", [True, False], ids=["pages", "scattered"])
def test_exchange_into_reused_slots_is_still_the_swap(aligned, overlap, backend):
    """Invariant: the exchange's slots may be any slots, including ones the stored tokens came
    from (the allocator freed and reused them; new bytes were written there meanwhile): the
    slots get the stored tokens, the blocks get the slots' bytes as they were just before."""
    lease = Lease("layers", seed=3)
    g, P = lease.g, lease.g.page_size
    engine = lease.engine(backend=backend)
    sx, sy, blocks, (xk, xv) = stored(lease, aligned, seed=5, engine=engine)
    n = len(sx)
    fresh_k, fresh_v = borrower_pool(g, lease.rows, seed=77)  # the reused slots' new bytes
    for layer in range(g.num_layers):
        lease.k[layer][sx] = fresh_k[layer][sx]
        lease.v[layer][sx] = fresh_v[layer][sx]
    if overlap == "all":
        ex = sx.clone()
    elif aligned:  # half of X's pages, half of the victims' pages, pages shuffled
        pages = torch.cat([sx.view(-1, P)[: n // P // 2], sy.view(-1, P)[n // P // 2:]])
        ex = pages[torch.randperm(pages.shape[0], generator=torch.Generator().manual_seed(8))]
        ex = ex.reshape(-1)
    else:
        ex = torch.cat([sx[: n // 2], sy[n // 2:]])
        ex = ex[torch.randperm(n, generator=torch.Generator().manual_seed(8))]
    assert len(set(ex.tolist()) & set(sx.tolist())) >= (n // 2 if overlap == "half" else n)
    before = snapshot(lease)
    result = run_exchange(engine, "here", ex, blocks)
    assert result.ok
    for layer in range(g.num_layers):
        assert same(lease.k[layer][ex], xk[layer]) and same(lease.v[layer][ex], xv[layer]), layer
    assert_state(lease, swapped_state(lease, before, ex, blocks, range(g.num_layers)))
    # a second exchange of the same pair swaps back: both sides as before the first one
    assert run_exchange(engine, "lane", ex, blocks).ok
    assert_state(lease, before)
    engine.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fenced_block_refuses_the_exchange_and_nothing_moves(backend):
    """Invariant: after fence(blocks) an exchange touching any of them is refused (FENCED, every
    layer failed) by both entry points and neither side changes; blocks not fenced still
    exchange."""
    lease = Lease("layers", seed=1)
    P, L = lease.g.page_size, lease.g.num_layers
    engine = lease.engine(backend=backend)
    _, sy, blocks, _ = stored(lease, True, seed=2, engine=engine)
    assert len(blocks) >= 3
    before = snapshot(lease)
    assert engine.fence(blocks[1:2]) == 0  # nothing in flight
    assert engine.fenced(blocks) and not engine.fenced(blocks[2:])
    refused = engine.exchange_here(sy, blocks)
    assert not refused.ok and refused.reason == FENCED and refused.failed_layers == tuple(range(L))
    handle = engine.begin_exchange(sy, blocks)
    assert handle.result() == refused  # refused at once, nothing enqueued
    assert handle.wait(5) == refused
    assert_state(lease, before)
    rest = blocks[2:]
    assert engine.exchange_here(sy[: len(rest) * P], rest).ok
    assert_state(lease, swapped_state(lease, before, sy[: len(rest) * P], rest, range(L)))
    engine.close()


@pytest.mark.parametrize("how", ["here", "lane"])
@pytest.mark.parametrize("cause", ["donor_lost", "deadline"])
def test_an_exchange_failing_mid_way_leaves_the_earlier_layers_swapped(cause, how):
    """Invariant (the contract the tree relies on): a donor lost, or the read deadline passed,
    before layer s stops the exchange there: it fails with layers s.. reported and that reason;
    layers before s are swapped on both sides, layers s.. are untouched on both sides. Both
    sides are thus a mix and the caller drops both (the slots' tokens and the blocks')."""
    lease = Lease("layers", seed=4)
    L, stop_at = lease.g.num_layers, 2
    _, sy, blocks, _ = stored(lease, False, seed=6)
    checks = []
    # liveness and the clock are asked before each layer and again after its copy
    if cause == "donor_lost":
        kw = dict(liveness=lambda: checks.append(None) or len(checks) <= 2 * stop_at)
    else:  # the clock reads 0, 1 around layer 0, 2, 3 around layer 1, 4 = the deadline
        ticks = itertools.count()
        kw = dict(clock=lambda: float(next(ticks)), read_deadline=lambda: float(2 * stop_at))
    engine = lease.engine(**kw)
    before = snapshot(lease)
    result = run_exchange(engine, how, sy, blocks)
    assert not result.ok and result.failed_layers == tuple(range(stop_at, L))
    assert result.reason == ("donor lost" if cause == "donor_lost" else "read deadline passed")
    assert_state(lease, swapped_state(lease, before, sy, blocks, range(stop_at)))
    engine.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fence_arriving_mid_exchange_stops_it_after_the_layer_in_flight(backend):
    """Invariant: a fence on a block of a running exchange aborts it and returns only once the
    layer being swapped is complete; no later layer moves (the earlier ones stay swapped)."""
    lease = Lease("layers", seed=5)
    L, stop_at = lease.g.num_layers, 3
    engine = lease.engine(backend=backend)
    _, sy, blocks, _ = stored(lease, True, seed=9, engine=engine)
    before = snapshot(lease)
    box, ready, fenced, threads = {}, threading.Event(), [], []
    real = engine._exchange_layer

    def slow(plan, layer, staging):
        out = real(plan, layer, staging)
        if layer == stop_at - 1:  # the fence comes while this layer's lock is still held
            assert ready.wait(10)
            t = threading.Thread(target=lambda: fenced.append(engine.fence(blocks[-1:])))
            t.start()
            threads.append(t)
            assert box["handle"]._abort.wait(10), "the fence did not abort the exchange"
            time.sleep(0.05)  # a window for a fence that (wrongly) would not wait for the layer
            assert not fenced, "the fence returned while a layer was still being swapped"
        return out

    engine._exchange_layer = slow
    box["handle"] = engine.begin_exchange(sy, blocks)
    ready.set()
    result = box["handle"].wait(30)
    threads[0].join(10)
    assert fenced == [1]
    # the layer the fence landed in is checked after its swap and reported failed (any state)
    assert not result.ok and result.failed_layers == tuple(range(stop_at - 1, L))
    assert_state(lease, swapped_state(lease, before, sy, blocks, range(stop_at)))
    engine.close()


class _StreamLane:
    """A lane that looks like a GPU lane (it has a stream); nothing may be submitted to it."""
    stream = object()

    def submit(self, fn, *args):
        raise AssertionError("nothing should be submitted")

    def close(self):
        pass


def test_exchange_here_refuses_a_gpu_lane_and_bad_transfers_before_anything_moves():
    """Invariant: exchange_here on an engine whose lane has a stream raises ValueError (a GPU
    copy is enqueued with begin_exchange); a wrong block count, a repeated block or a repeated
    slot raise ValueError from both entry points; none of them moves a byte. An empty exchange
    is a successful no-op."""
    lease = Lease("layers")
    P = lease.g.page_size
    before = snapshot(lease)
    slots = lease.slots(2 * P, True, 1)
    gpu_like = lease.engine(lane=_StreamLane())
    with pytest.raises(ValueError, match="exchange_here"):
        gpu_like.exchange_here(slots, [0, 1])
    engine = lease.engine()
    twice = torch.cat([slots[:P], slots[:P]])
    for entry in (engine.exchange_here, engine.begin_exchange):
        for s, b, match in ((slots, [0], "need 2 blocks"), (slots, [2, 2], "repeats"),
                            (twice, [0, 1], "one slot twice"),
                            (slots, [0, lease.packing.num_blocks], "lease holds")):
            with pytest.raises(ValueError, match=match):
                entry(s, b)
    assert engine.exchange_here([], []).ok and engine.begin_exchange([], []).wait(5).ok
    assert_state(lease, before)
    engine.close()
