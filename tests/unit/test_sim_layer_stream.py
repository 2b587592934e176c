"""The stepwise layer stream model (simulator/layer_stream.py, long_context.py): its figures
respond to bandwidth, depth and memory the way the live server's rules say they must."""

from dataclasses import replace

import pytest

from benchmarks.simulator import long_context as lc
from benchmarks.simulator import params
from benchmarks.simulator.layer_stream import StreamedRequest, StreamSetup, run_request
from benchmarks.simulator.roofline import Roofline

HUGE = 1e30  # bytes/s: a link that moves anything in no time


def _setup(nvlink=200e9, pcie=32e9, depth=2, donor=(1e12,), host=1e12,
           model="LWM-Text-1M") -> StreamSetup:
    hw = params.gpu("H20")
    rl = Roofline(params.MODELS[model], hw["bf16_flops"], hw["hbm_bw"], 0.6, 0.7)
    return StreamSetup(rl, depth, donor, host, nvlink, pcie, 8192)


def test_infinite_links_leave_only_the_staging_write():
    """With links that take no time, a decode step costs the resident step plus one HBM write
    of the staged rows (and the write-through read), nothing else; prefill is compute-bound and
    its slowdown is 1."""
    ss = _setup(nvlink=HUGE, pcie=HUGE)
    ctx = 100_000
    s = run_request(ss, ctx, 2)
    r = run_request(ss, ctx, 2, streamed=False)
    rl = ss.roofline
    kv = rl.model.kv_bytes_per_token
    items = [(1, ctx + 0.5)]
    expected = (rl.step_bytes(items) + (ctx + 0.5) * kv + kv) / (rl.hbm_bw * rl.eff_hbm)
    assert s["decode_step_s"] == pytest.approx(expected, rel=1e-6)
    assert s["ttft_s"] / r["ttft_s"] == pytest.approx(1.0, abs=2e-3)


def test_decode_slowdown_falls_as_link_bandwidth_rises_and_respects_the_link_bound():
    """A streamed decode step never beats the time its loads need on the link, and more
    bandwidth never makes it slower; at a link far faster than HBM it meets the resident step
    plus the staging write."""
    ctx = 50_000
    steps = []
    for bw in (10e9, 50e9, 200e9, 1e12, 1e14):
        ss = _setup(nvlink=bw, pcie=bw, donor=(1e13,))
        step = run_request(ss, ctx, 1)["decode_step_s"]
        assert step >= ctx * ss.roofline.model.kv_bytes_per_token / bw * (1 - 1e-9)
        steps.append(step)
    assert steps == sorted(steps, reverse=True)
    resident = run_request(_setup(), ctx, 1, streamed=False)["decode_step_s"]
    assert steps[-1] < 2.1 * resident


def test_deeper_staging_never_slows_a_step_and_depth_one_serializes():
    """Depth D lets D-1 loads run ahead of compute: more depth never costs time, and depth 1
    (load, then compute, layer after layer) is slower than depth 2 when both sides take time."""
    ctx = 20_000
    # a link where one layer's load takes about one layer of compute
    ss2 = _setup(depth=2)
    resident = run_request(ss2, ctx, 1, streamed=False)["decode_step_s"]
    layer_load = ctx * ss2.layer_token_bytes
    bw = layer_load / (resident / ss2.roofline.model.layers)
    by_depth = [run_request(_setup(nvlink=bw, depth=d), ctx, 1)["decode_step_s"]
                for d in (1, 2, 3, 4)]
    assert all(a >= b * (1 - 1e-9) for a, b in zip(by_depth, by_depth[1:]))
    assert by_depth[0] > 1.3 * by_depth[1]


def test_loads_and_write_through_go_where_the_tokens_live():
    """Tokens fill the donor lease first, then host memory: a context inside the lease loads and
    writes nothing over PCIe; one beyond it splits its rows between NVLink and PCIe by placement."""
    ss = _setup(donor=(1000 * params.MODELS["LWM-Text-1M"].kv_bytes_per_token,), host=1e13)
    req = StreamedRequest(ss)
    req.forward(800, 1)
    assert req.h2d.bytes_moved == 0 and req.d2h.bytes_moved == 0
    per = ss.layer_token_bytes * ss.roofline.model.layers
    assert req.nvl_in.bytes_moved == pytest.approx(800 * per)
    req2 = StreamedRequest(ss)
    req2.forward(1500, 1)
    assert req2.nvl_in.bytes_moved == pytest.approx(1000 * per)
    assert req2.h2d.bytes_moved == pytest.approx(500 * per)
    assert req2.d2h.bytes_moved == pytest.approx(per)  # the new token lives on the host


def test_a_load_bound_step_is_every_layer_load_in_a_row():
    """When the link is the bottleneck, one lane moves the layers one after another: the step is
    the sum of the layer loads plus the last layer's compute (hand computation)."""
    ctx = 10_000
    ss = _setup(nvlink=1e9, donor=(1e13,))
    req = StreamedRequest(ss)
    req.forward(ctx, 1)  # the first forward pays nothing before it; measure the second
    step = req.forward(ctx + 1, 1)
    L = ss.roofline.model.layers
    load = (ctx + 1) * ss.layer_token_bytes / 1e9
    write = ss.layer_token_bytes / 1e9
    assert step == pytest.approx(L * (load + write), rel=0.01)


def test_max_context_never_exceeds_the_memory_bounds():
    """The sweep's maximum is within one resolution step below every bound (streamable memory,
    staging in the local pool, the window); the baselines' is the local pool."""
    for setup in (lc.LWM_H20, replace(lc.LWM_H20, host_bytes=2e12),
                  replace(lc.LWM_H20, depth=16, host_bytes=2e12)):
        res = lc.max_context(setup)
        bound = min(v for v in res["memory_bound_tokens"].values() if v)
        assert bound - 64 <= res["max_tokens"]["swiftcache"] <= bound
        kv = params.MODELS[setup.model].kv_bytes_per_token
        assert res["max_tokens"]["sglang"] <= setup.local_bytes() / kv
        assert res["max_tokens"]["sglang"] > setup.local_bytes() / kv - 64


def test_the_sweep_admits_nothing_when_even_the_first_length_does_not_fit():
    """No streamable memory: no context is admitted, and nothing is simulated."""
    res = lc.max_context(replace(lc.LWM_H20, donors=(), host_bytes=0.0))
    assert res["max_tokens"]["swiftcache"] == 0 and res["probes"] == []


def test_a_request_beyond_streamable_memory_is_refused_by_name():
    """run_request refuses a context the streamable memory cannot hold, naming both sizes."""
    with pytest.raises(ValueError, match="streamable memory"):
        run_request(_setup(donor=(1e9,), host=0.0), 10_000, 1)
