"""Simulator engine: event ordering, link fair sharing, roofline arithmetic (hand-checked cases)."""

import pytest

from benchmarks.simulator.clock import EventLoop
from benchmarks.simulator.links import Network
from benchmarks.simulator.params import (
    MODELS,
    assumptions_table,
    gpu,
    kv_pool_bytes,
    reserved_mem_bytes,
)
from benchmarks.simulator.roofline import Roofline


def test_events_run_in_time_order_and_fifo_on_ties():
    """Events run by time; equal times run in the order they were scheduled."""
    loop = EventLoop()
    seen = []
    loop.at(2.0, lambda: seen.append("c"))
    loop.at(1.0, lambda: seen.append("a"))
    loop.at(1.0, lambda: seen.append("b"))
    loop.after(0.5, lambda: loop.after(1.0, lambda: seen.append("d")))  # runs at 1.5
    loop.run()
    assert seen == ["a", "b", "d", "c"]
    assert loop.now == 2.0


def test_events_never_scheduled_in_the_past():
    """Scheduling before the current time is refused."""
    loop = EventLoop()
    loop.at(1.0, lambda: None)
    loop.run()
    with pytest.raises(ValueError):
        loop.at(0.5, lambda: None)


def test_one_transfer_takes_bytes_over_bandwidth():
    """A transfer alone on a link takes bytes / bandwidth and moves exactly its bytes."""
    loop = EventLoop()
    net = Network(loop)
    link = net.add_link("pcie", 32e9)
    done = []
    net.start([link], 8e9, lambda t: done.append(loop.now))
    loop.run()
    assert done == [pytest.approx(0.25, rel=1e-12)]
    assert link.bytes_moved == pytest.approx(8e9)


def test_two_transfers_sharing_a_link_take_twice_as_long():
    """Two equal transfers on one link share it fairly and end together at 2 B / W."""
    loop = EventLoop()
    net = Network(loop)
    link = net.add_link("nvlink", 200e9)
    done = []
    for _ in range(2):
        net.start([link], 100e9, lambda t: done.append(loop.now))
    loop.run()
    assert done == [pytest.approx(1.0), pytest.approx(1.0)]


def test_late_joiner_shares_then_gets_full_rate():
    """A transfer that joins later shares the link, and the one left gets the full rate back."""
    # A: 10 B on a 1 B/s link from t=0; B: 2 B from t=4. A moves 4 B alone, then both at 0.5 B/s:
    # B finishes at t=8 (2 B at 0.5), A has 6-2=4 B left at t=8 and ends at t=12.
    loop = EventLoop()
    net = Network(loop)
    link = net.add_link("l", 1.0)
    ends = {}
    net.start([link], 10, lambda t: ends.__setitem__("A", loop.now))
    loop.at(4.0, lambda: net.start([link], 2, lambda t: ends.__setitem__("B", loop.now)))
    loop.run()
    assert ends["B"] == pytest.approx(8.0)
    assert ends["A"] == pytest.approx(12.0)


def test_path_rate_is_max_min_fair_across_links():
    """Rates are max-min fair: a path is capped by its slowest link and others take the rest."""
    # Flow X crosses slow(1) and fast(4); flow Y only fast. X is capped at 1 by slow; Y gets 3.
    loop = EventLoop()
    net = Network(loop)
    slow, fast = net.add_link("slow", 1.0), net.add_link("fast", 4.0)
    ends = {}
    net.start([slow, fast], 1.0, lambda t: ends.__setitem__("X", loop.now))
    net.start([fast], 3.0, lambda t: ends.__setitem__("Y", loop.now))
    loop.run()
    assert ends["X"] == pytest.approx(1.0)
    assert ends["Y"] == pytest.approx(1.0)


def test_rate_through_reports_current_flow():
    """rate_through reports the bytes/s flowing through a link now."""
    loop = EventLoop()
    net = Network(loop)
    link = net.add_link("l", 10.0)
    net.start([link], 100.0)
    assert net.rate_through(link) == pytest.approx(10.0)


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound():
    """Decode costs bytes / (HBM x efficiency); a long prefill costs FLOPs / (peak x efficiency)."""
    h20 = gpu("H20")
    m = MODELS["Qwen3-32B"]
    rl = Roofline(m, h20["bf16_flops"], h20["hbm_bw"], 0.6, 0.7)
    # one decode token at 1000 context: bytes = weights + 1001 KV tokens.
    b = m.weight_bytes + 1001 * m.kv_bytes_per_token
    assert rl.step_time([(1, 1000)]) == pytest.approx(b / (4.0e12 * 0.7))
    # 8192-token prefill from scratch: FLOPs dominate.
    f = 2 * m.nonembed_params * 8192 + 4 * 64 * 64 * 128 * 8192 * (8193 / 2)
    assert rl.step_time([(8192, 0)]) == pytest.approx(f / (148e12 * 0.6))


def test_dma_traffic_slows_memory_bound_steps():
    """Copy-engine traffic into HBM is taken from the bandwidth a memory-bound step sees."""
    h20 = gpu("H20")
    rl = Roofline(MODELS["Qwen3-8B"], h20["bf16_flops"], h20["hbm_bw"], 0.6, 0.7)
    base = rl.step_time([(1, 4000)] * 8)
    slowed = rl.step_time([(1, 4000)] * 8, hbm_bw_taken=200e9)
    assert slowed == pytest.approx(base * 2.8e12 / 2.6e12)


def test_kv_bytes_and_pool_sizes_follow_the_model_configs():
    """KV bytes/token = 2 x layers x KV heads x head_dim x 2 B (Qwen3 configs); SGLang's reserve
    keeps its 10 GB floor; every parameter names its source."""
    assert MODELS["Qwen3-32B"].kv_bytes_per_token == 262144
    assert MODELS["Qwen3-8B"].kv_bytes_per_token == 147456
    assert reserved_mem_bytes() >= 10 * 1024**3
    assert 10e9 < kv_pool_bytes("H20", MODELS["Qwen3-32B"]) < 25e9
    assert all(row[3] for row in assumptions_table())  # every parameter has a source


def test_parameter_sources_are_primary_sources():
    """Each parameter cites a datasheet, model config, SGLang source or doc, measurement or the
    paper (arXiv id), never a note that is not in this repository."""
    import re

    for name, _, _, source in assumptions_table():
        assert not re.search(r"landscape|paper\.md|notes/|\.md \d", source), (name, source)
