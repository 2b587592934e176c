"""Load generator: workload generation, statistics, and the streaming client against a fake server.

The fake server is a real aiohttp app on 127.0.0.1 that streams SSE like SGLang; the tests await
its responses (no sleeps used as waits).
"""

import asyncio
import json

import pytest
from aiohttp import web

from sglang_swift.loadgen import runner, stats
from sglang_swift.workloads.text_sessions import AgentSpec, ChatSpec, agent_sessions, chat_sessions, poisson_arrivals


def test_agent_sessions_are_seeded_and_follow_the_stated_bounds():
    spec = AgentSpec(num_sessions=5, seed=3)
    a, b = agent_sessions(spec), agent_sessions(spec)
    assert a == b
    assert agent_sessions(AgentSpec(num_sessions=5, seed=4)) != a
    for s in a:
        assert spec.steps_min <= len(s.steps) <= spec.steps_max
        assert spec.system_min <= len(s.system.split()) - 6 <= spec.system_max
        for st in s.steps[1:]:
            assert spec.tool_min <= len(st.user.split()) - 2 <= spec.tool_max


def test_chat_sessions_keep_real_turn_order():
    sess = chat_sessions(ChatSpec(num_sessions=3, max_turns=4, min_turns=2, max_chars=100, seed=1))
    assert len(sess) == 3
    assert all(2 <= len(s.steps) <= 4 for s in sess)
    assert all(1 <= st.max_tokens <= 128 for s in sess for st in s.steps)


def test_poisson_arrivals_have_the_requested_mean_gap():
    t = poisson_arrivals(4000, rate=2.0, seed=0)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert (t[-1] / (len(t) - 1)) == pytest.approx(0.5, rel=0.06)


def test_summary_percentiles_and_per_turn_hit_rate():
    recs = [dict(turn=i % 2, ttft=0.01 * (i + 1), e2e=0.1, itls=[0.001, 0.003], error=None,
                 prompt_tokens=100, cached_tokens=(0 if i % 2 == 0 else 80)) for i in range(10)]
    s = stats.summarize(recs)
    assert s["ok"] == 10
    assert s["ttft_p50"] == pytest.approx(0.055)
    assert s["itl_p50"] == pytest.approx(0.002)
    assert s["cache_hit_rate"] == pytest.approx(0.4)
    assert s["per_turn"][0]["hit_rate"] == 0.0 and s["per_turn"][1]["hit_rate"] == pytest.approx(0.8)
    r = stats.ratios(s, {k: (v / 2 if isinstance(v, float) else v) for k, v in s.items()})
    assert r["ttft_p99"] == pytest.approx(0.5)


def _fake_app(log):
    """Streams 3 output events per request; cached_tokens = length of the previous prompt seen."""
    seen = {"last": 0}

    async def generate(request):
        body = await request.json()
        log.append(("generate", body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ptoks = len(body["text"].split())
        for n in range(1, 4):
            ev = {"text": "ok " * n, "meta_info": {"prompt_tokens": ptoks, "completion_tokens": n,
                                                   "cached_tokens": seen["last"]}}
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        seen["last"] = ptoks
        return resp

    async def chat(request):
        body = await request.json()
        log.append(("chat", body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in ("a", "b", "c"):
            await resp.write(f"data: {json.dumps({'choices': [{'delta': {'content': piece}}]})}\n\n".encode())
        usage = {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 5}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def flush(request):
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.post("/generate", generate), web.post("/v1/chat/completions", chat),
                    web.post("/flush_cache", flush)])
    return app


async def _with_server(fn):
    log = []
    app_runner = web.AppRunner(_fake_app(log))
    await app_runner.setup()
    site = web.TCPSite(app_runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await fn(f"http://127.0.0.1:{port}"), log
    finally:
        await app_runner.cleanup()


def test_generate_client_measures_ttft_itl_and_cached_tokens():
    sess = agent_sessions(AgentSpec(num_sessions=1, steps_min=3, steps_max=3, system_min=5, system_max=5,
                                    tool_median=5, tool_min=2, tool_max=9, tool_latency_s=0.0, seed=0))
    recs, log = asyncio.run(_with_server(lambda url: runner.run_sessions(url, "fake", sess, 1.0)))
    assert [r.turn for r in recs] == [0, 1, 2]
    assert all(r.error is None and r.ttft is not None and r.e2e >= r.ttft for r in recs)
    assert all(r.completion_tokens == 3 and len(r.itls) == 2 for r in recs)
    # each prompt extends the previous prompt plus its answer: the prefix property a cache needs
    prompts = [b["text"] for _, b in log]
    assert prompts[1].startswith(prompts[0]) and prompts[2].startswith(prompts[1])
    assert recs[1].cached_tokens == recs[0].prompt_tokens


def test_chat_client_reads_usage_and_sends_history():
    sess = chat_sessions(ChatSpec(num_sessions=1, max_turns=2, min_turns=2, max_chars=50, think_mean_s=0))
    recs, log = asyncio.run(_with_server(lambda url: runner.run_sessions(url, "fake", sess, 1.0, api="chat")))
    assert recs[0].text == "abc" and recs[0].cached_tokens == 5 and recs[0].prompt_tokens == 7
    msgs = log[1][1]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"] and msgs[1]["content"] == "abc"


def test_cli_runs_two_servers_and_writes_json_and_plots(tmp_path):
    from sglang_swift.loadgen import cli

    async def go(url):
        a = cli.build_parser().parse_args(["--server", f"off={url}", "--server", f"on={url}", "--quick",
                                           "--workload", "agent", "--think-mean", "0", "--rates", "1000", "--out", str(tmp_path)])
        cli._apply_quick(a)
        a.think_mean = 0.0
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, cli.run, a, {"off": url, "on": url})

    results, _ = asyncio.run(_with_server(go))
    lines = cli.report(results, tmp_path)
    assert any(line.startswith("== ratios on/off") for line in lines)
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 0
    assert (tmp_path / "p99_ttft_vs_rate.png").exists() and (tmp_path / "ttft_per_turn.png").exists()
