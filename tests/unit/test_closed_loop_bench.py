"""The closed loop of `bench_node.py --closed-loop` (benchmarks/nodebench/closed_loop.py).

Invariants, against a local HTTP server that streams /generate like SGLang: every client sends
its rounds in order, each round's prompt is the client's history (earlier prompts and the forced
answers) plus its new tokens; never more than `max_parallel` requests are in flight; TTFT and
cached tokens are read from the stream; the summary's ratios are SwiftCache over the upper
bound (stock SGLang with one device pool of the busy pool, the loan and the host tier), and
SwiftCache above it is reported with its cause; outputs compare on token ids, two empty answers
never matching.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from benchmarks.nodebench.closed_loop import (
    ClosedLoop,
    Turn,
    drive,
    hicache_args,
    host_pool_tokens,
    summarize,
    unlimited_cache_tokens,
    upper_bound_run,
)
from benchmarks.nodebench.plan import NodePlan


class FakeServer:
    """An aiohttp server answering /generate with two SSE events (the output ids so far)."""

    def __init__(self):
        self.prompts: list[list[int]] = []
        self.in_flight = self.most_in_flight = 0

    async def generate(self, request):
        from aiohttp import web

        body = await request.json()
        self.prompts.append(body["input_ids"])
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["sampling_params"]["max_new_tokens"]
        out = [len(body["input_ids"]) % 97 + i for i in range(n)]
        for k in (1, n):
            await asyncio.sleep(0.01)
            ev = {"text": "x", "output_ids": out[:k],
                  "meta_info": {"completion_tokens": k, "prompt_tokens": len(body["input_ids"]),
                                "cached_tokens": 3}}
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        return resp


def _serve(fake: FakeServer):
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/generate", fake.generate)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{port}", loop, runner


@pytest.fixture
def server():
    fake = FakeServer()
    url, loop, runner = _serve(fake)
    yield fake, url
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)


def test_clients_send_their_rounds_in_order_on_their_forced_histories(server):
    fake, url = server
    load = ClosedLoop(clients=3, rounds=3, request_length=5, output_length=4, max_parallel=2,
                      request_rate=float("inf"))
    forced = {(c, r): (1000 + 10 * c + r,) * 4 for c in range(3) for r in range(3)}
    turns = asyncio.run(drive(url, load, vocab=500, forced=forced))
    assert len(turns) == 9 and fake.most_in_flight <= 2
    by_client: dict = {}
    for t in turns:
        by_client.setdefault(t.client, []).append(t)
    for ts in by_client.values():
        assert [t.round for t in ts] == [0, 1, 2]
        assert all(t.ttft is not None and t.cached == 3 and len(t.output) == 4 for t in ts)
    prompts = sorted(fake.prompts, key=len)
    for p in prompts:  # each later prompt extends an earlier one by its forced answer
        rounds = len(p) // (5 + 4) + (1 if len(p) % 9 else 0)
        assert len(p) == 5 * rounds + 4 * (rounds - 1)
        for r in range(rounds - 1):
            answer = p[(r + 1) * 5 + r * 4:(r + 1) * 9]
            assert len(set(answer)) == 1 and answer[0] >= 1000


def test_bad_load_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="--max-parallel"):
        ClosedLoop(max_parallel=0)
    with pytest.raises(ValueError, match="--request-rate"):
        ClosedLoop(request_rate=0)


def _run(ttfts, cached, output=(1,)):
    return {"turns": [Turn(0, i, ttft=t, cached=cached, prompt=10, output=output)
                      for i, t in enumerate(ttfts)], "wall_s": 1.0, "stats": {},
            "loadavg": [0.0] * 6}


POOLS = {"upper_bound": {"busy": 2561, "donor": 2048}}


def test_the_summary_compares_swiftcache_and_the_twin_with_the_upper_bound():
    runs = {"stock": _run([0.3, 0.3], 0), "swiftcache": _run([0.22, 0.22], 6),
            "upper_bound": _run([0.2, 0.2], 8), "upper_bound_twin": _run([0.21, 0.21], 8)}
    s = summarize(runs, NodePlan(), ClosedLoop(), POOLS)
    assert s["closed_loop_ttft_avg_vs_upper_bound"] == pytest.approx(1.1)
    assert s["closed_loop_ttft_p99_noise"] == pytest.approx(1.05)
    assert s["stock_ttft_avg_vs_upper_bound"] == pytest.approx(1.5)
    assert s["cached_vs_upper_bound"] == 0.75 and s["identical"] is True
    assert s["upper_bound_exceeded"] is None and s["upper_bound_pool"] == 2561
    assert not any("ideal" in k for k in s)


def test_swiftcache_above_the_upper_bound_is_reported_with_its_cause():
    runs = {"stock": _run([0.3], 0), "swiftcache": _run([0.2], 9),
            "upper_bound": _run([0.2], 8), "upper_bound_twin": _run([0.2], 8)}
    s = summarize(runs, NodePlan(), ClosedLoop(), POOLS)
    assert s["cached_vs_upper_bound"] > 1
    assert s["upper_bound_exceeded"]["by_tokens"] == 1
    assert "nondeterminism" in s["upper_bound_exceeded"]["why"]


def test_the_unlimited_cache_bound_counts_each_previous_prompt_and_answer():
    """Round r's prompt starts with round r-1's prompt and answer: a cache that never evicts
    serves exactly those; round 0 is new tokens only."""
    load = ClosedLoop(output_length=4)
    turns = [Turn(c, r, ttft=0.3, prompt=10 * (r + 1) + c, output=(1,)) for c in range(2)
             for r in range(3)]
    # client 0: rounds 1, 2 reuse 10 + 4 and 20 + 4; client 1: 11 + 4 and 21 + 4
    assert unlimited_cache_tokens(turns, load) == 14 + 24 + 15 + 25
    runs = {"stock": {**_run([0.3], 0), "turns": turns},
            "swiftcache": _run([0.2], 39), "upper_bound": _run([0.2], 30),
            "upper_bound_twin": _run([0.2], 30)}
    s = summarize(runs, NodePlan(), load, POOLS)
    assert s["unlimited_cache_tokens"] == 78 and s["cached_vs_unlimited_cache"] == 0.5


def test_two_empty_answers_are_a_mismatch():
    runs = {"stock": _run([0.3], 0, ()), "swiftcache": _run([0.2], 0, ()),
            "upper_bound": _run([0.2], 0, ()), "upper_bound_twin": _run([0.2], 0, ())}
    s = summarize(runs, NodePlan(), ClosedLoop(), POOLS)
    assert s["mismatches"]["swiftcache"] == 1 and s["identical"] is False


def test_the_upper_bound_is_one_stock_pool_of_busy_lent_and_host_tokens():
    plan = NodePlan()  # busy 1024, donor 4096
    host = host_pool_tokens(plan, 1.0)
    assert host == 1025 and host_pool_tokens(plan, 0.0) == 0
    bound = upper_bound_run(plan, 512, 2048, host)
    assert (bound.busy_pool, bound.donor_pool) == (1024 + 512 + 1025, 4096 - 2048)
    assert not bound.swiftcache and bound.name == "upper_bound"
    assert "--enable-hierarchical-cache" not in bound.busy_args(plan, "rv", 0)
    assert hicache_args(1.0)[:3] == ["--enable-hierarchical-cache", "--hicache-ratio",
                                     "1.000000"]
    with pytest.raises(ValueError, match="upper bound"):
        upper_bound_run(plan, 512, 4096, host)
