"""The closed-loop mode (clients, rounds, lengths, max parallel) and the long-context sweep's
rules (resident rows, the live host-backed store)."""

import math
from dataclasses import replace

import pytest

from benchmarks.simulator import closed_loop as cl
from benchmarks.simulator import long_context as lc
from benchmarks.simulator.capacity import PAGE_TOKENS, master_tier_pages
from benchmarks.simulator.layer_stream import StreamedRequest
from benchmarks.simulator.scenario import PAPER


def test_capacity_clients_is_device_plus_host_over_a_final_history():
    """HiCache's capacity in clients: its device + host tokens / rounds x (request + output)."""
    loop = cl.ClosedLoop(1, rounds=4, request_length=1000, output_length=24)
    p = master_tier_pages(PAPER, True, False)
    assert cl.capacity_clients(PAPER, loop) == pytest.approx(
        (p["device"] + p["host"]) * PAGE_TOKENS / 4096)


def test_every_round_is_answered_its_history_is_cached_and_max_parallel_holds():
    """3 clients x 3 rounds, at most 2 in flight: 9 answers; round k's prompt is k x (request +
    output) + request tokens; later rounds find their history in the cache; never more than 2
    requests outstanding at once."""
    loop = cl.ClosedLoop(3, rounds=3, request_length=640, output_length=64, max_parallel=2)
    out = cl.run(PAPER, "sglang-hicache", loop)
    assert out["requests"] == 9
    assert out["prompt_tokens"] == 3 * sum(k * 704 + 640 for k in range(3))
    assert out["cached_tokens"] > 0 and out["hits_by_tier"]["device"] > 0


def test_the_sender_never_exceeds_max_parallel(monkeypatch):
    """Arrivals and first tokens of every request: at any arrival, at most max_parallel
    requests have arrived and not finished."""
    seen = []
    real = cl.SimRequest

    def spy(*a, **k):
        r = real(*a, **k)
        seen.append(r)
        return r

    monkeypatch.setattr(cl, "SimRequest", spy)
    cl.run(PAPER, "swiftcache", cl.ClosedLoop(6, rounds=2, request_length=256, max_parallel=2))
    for r in seen:
        busy = [x for x in seen if x.arrival <= r.arrival and x.finish > r.arrival]
        assert len(busy) <= 2


def test_bad_closed_loop_settings_are_refused():
    with pytest.raises(ValueError):
        cl.ClosedLoop(0)
    with pytest.raises(ValueError):
        cl.ClosedLoop(2, ready_queue_policy="lifo")
    assert math.isinf(cl.ClosedLoop(2).request_rate)


def test_resident_rows_are_neither_loaded_nor_written_through():
    """A setup whose first 1000 tokens are resident: a forward over 1500 cached tokens loads only
    500 tokens' rows per layer; writes of tokens below 1000 copy nothing."""
    base = lc.LWM_H20
    ss = replace(base.stream_setup(), resident_tokens=1000)
    req = StreamedRequest(ss)
    loads = req._parts(0, 1500, load=True)
    assert sum(b for _, b in loads) == pytest.approx(500 * ss.layer_token_bytes)
    assert req._parts(900, 1000, load=False) == []


def test_the_live_store_holds_every_row_in_host_and_writes_there_too():
    """Host-backed: the context fits only host memory (the lease adds no room) and every new
    token is written to host besides its lease copy."""
    ss = replace(lc.LWM_H20.stream_setup(), host_backed=True, host_bytes=1e9)
    kv = ss.roofline.model.kv_bytes_per_token
    assert ss.fits(int(1e9 // kv)) and not ss.fits(int(1e9 // kv) + 1)
    writes = StreamedRequest(ss)._parts(0, 10, load=False)
    assert sum(b for _, b in writes) == pytest.approx(2 * 10 * ss.layer_token_bytes)


def test_the_additive_design_with_every_lease_and_half_resident_passes_the_papers_ratio():
    """LWM on an H20, idle donors lending their whole pools, 64 GB host, half resident, leases
    adding room: past 3.98x; the live host-backed store with 64 GB stays below stock."""
    add = lc.max_context(replace(lc.LWM_H20, lend_fraction=1.0, host_bytes=64e9,
                                 resident_fraction=0.5))
    live = lc.max_context(replace(lc.LWM_H20, lend_fraction=1.0, host_bytes=64e9,
                                  resident_fraction=0.5, host_backed=True))
    assert add["ratio"] >= 3.98 and live["ratio"] < 1.0
