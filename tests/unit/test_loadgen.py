"""Load generator: statistics, and the streaming client and CLI against a fake server.

The fake server is a real aiohttp app on 127.0.0.1 that streams SSE like SGLang; the tests await
its responses (no sleeps used as waits).
"""

import asyncio
import json

import pytest
from aiohttp import web

from sglang_swift.loadgen import runner, stats
from sglang_swift.workloads.specs import AgentWorkload, ChatWorkload
from sglang_swift.workloads.text_sessions import agent_sessions, chat_sessions


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
    sess = agent_sessions(AgentWorkload(steps_min=3, steps_max=3, system_min=5, system_max=5, tool_median=5,
                                        tool_min=2, tool_max=9, output_min=48, output_max=48,
                                        tool_latency_mean_s=0.0, shared_system_prompt=False, seed=0), 1)
    recs, log = asyncio.run(_with_server(lambda url: runner.run_sessions(url, "fake", sess, 1.0)))
    assert [r.turn for r in recs] == [0, 1, 2]
    assert all(r.error is None and r.ttft is not None and r.e2e >= r.ttft for r in recs)
    assert all(r.completion_tokens == 3 and len(r.itls) == 2 for r in recs)
    # each prompt extends the previous prompt plus its answer: the prefix property a cache needs
    prompts = [b["text"] for _, b in log]
    assert prompts[1].startswith(prompts[0]) and prompts[2].startswith(prompts[1])
    assert recs[1].cached_tokens == recs[0].prompt_tokens


def test_chat_client_reads_usage_and_sends_history():
    sess = chat_sessions(ChatWorkload(max_turns=2, min_turns=2, max_chars_per_message=50, max_output_tokens=128,
                                      think_mean_s=0), 1)
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
