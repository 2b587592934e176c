"""Load generator: statistics, and the streaming client and CLI against a fake server.

The fake server is a real aiohttp app on 127.0.0.1 that streams SSE like SGLang; the tests await
its responses (no sleeps used as waits).
"""

import asyncio
import json
import os

import pytest
from aiohttp import web

from benchmarks.loadgen import frontend, runner, stats
from benchmarks.workloads.frontend_programs import agent_programs
from benchmarks.workloads.specs import AgentWorkload, ChatWorkload
from benchmarks.workloads.text_sessions import agent_sessions, chat_sessions


def test_summary_percentiles_and_per_turn_hit_rate():
    recs = [dict(turn=i % 2, ttft=0.01 * (i + 1), e2e=0.1, itls=[0.001, 0.003], error=None,
                 prompt_tokens=100, cached_tokens=(0 if i % 2 == 0 else 80)) for i in range(10)]
    s = stats.summarize(recs)
    assert s["ok"] == 10
    assert s["ttft_p50"] == pytest.approx(0.055)
    assert s["itl_p50"] == pytest.approx(0.002)
    assert s["cache_hit_rate"] == pytest.approx(0.4)
    assert s["per_turn"][0]["hit_rate"] == 0.0
    assert s["per_turn"][1]["hit_rate"] == pytest.approx(0.8)
    r = stats.ratios(s, {k: (v / 2 if isinstance(v, float) else v) for k, v in s.items()})
    assert r["ttft_p99"] == pytest.approx(0.5)


def _fake_app(log):
    """Streams 3 output events per request; cached_tokens = length of the previous prompt seen."""
    seen = {"last": 0, "prompts": []}

    async def generate(request):
        body = await request.json()
        log.append(("generate", body))
        if not body.get("stream"):  # the SGLang frontend's RuntimeEndpoint: one JSON answer
            prompt = body["text"]
            cached = max((len(os.path.commonprefix([prompt, p])) for p in seen["prompts"]),
                         default=0)
            seen["prompts"].append(prompt)
            n = body["sampling_params"].get("max_new_tokens", 0)
            text = f" out{len(prompt) % 97}" * min(n, 2)
            return web.json_response({"text": text, "meta_info": {
                "prompt_tokens": len(prompt), "cached_tokens": cached, "completion_tokens": n}})
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
            delta = {"choices": [{"delta": {"content": piece}}]}
            await resp.write(f"data: {json.dumps(delta)}\n\n".encode())
        usage = {"prompt_tokens": 7, "completion_tokens": 3,
                 "prompt_tokens_details": {"cached_tokens": 5}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def flush(request):
        return web.Response(text="ok")

    async def model_info(request):
        return web.json_response({"model_path": "fake-model"})

    app = web.Application()
    app.add_routes([web.post("/generate", generate), web.post("/v1/chat/completions", chat),
                    web.post("/flush_cache", flush), web.get("/get_model_info", model_info)])
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
    sess = agent_sessions(AgentWorkload(steps_min=3, steps_max=3, system_min=5, system_max=5,
                                        tool_median=5, tool_min=2, tool_max=9, output_min=48,
                                        output_max=48, tool_latency_mean_s=0.0,
                                        shared_system_prompt=False, seed=0), 1)
    recs, log = asyncio.run(_with_server(lambda url: runner.run_sessions(url, "fake", sess, 1.0)))
    assert [r.turn for r in recs] == [0, 1, 2]
    assert all(r.error is None and r.ttft is not None and r.e2e >= r.ttft for r in recs)
    assert all(r.completion_tokens == 3 and len(r.itls) == 2 for r in recs)
    # each prompt extends the previous prompt plus its answer: the prefix property a cache needs
    prompts = [b["text"] for _, b in log]
    assert prompts[1].startswith(prompts[0]) and prompts[2].startswith(prompts[1])
    assert recs[1].cached_tokens == recs[0].prompt_tokens


def test_chat_client_reads_usage_and_sends_history():
    sess = chat_sessions(ChatWorkload(max_turns=2, min_turns=2, max_chars_per_message=50,
                                      max_output_tokens=128, think_mean_s=0), 1)
    recs, log = asyncio.run(_with_server(
        lambda url: runner.run_sessions(url, "fake", sess, 1.0, api="chat")))
    assert recs[0].text == "abc" and recs[0].cached_tokens == 5 and recs[0].prompt_tokens == 7
    msgs = log[1][1]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[1]["content"] == "abc"


def test_cli_runs_two_servers_and_writes_json_and_plots(tmp_path):
    from benchmarks.loadgen import cli

    async def go(url):
        a = cli.build_parser().parse_args(["--server", f"off={url}", "--server", f"on={url}",
                                           "--quick", "--workload", "agent", "--think-mean", "0",
                                           "--rates", "1000", "--out", str(tmp_path)])
        cli._apply_quick(a)
        a.think_mean = 0.0
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, cli.run, a, {"off": url, "on": url})

    results, _ = asyncio.run(_with_server(go))
    lines = cli.report(results, tmp_path)
    assert any(line.startswith("== ratios on/off") for line in lines)
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 0
    assert (tmp_path / "p99_ttft_vs_rate.png").exists()
    assert (tmp_path / "ttft_per_turn.png").exists()


def _run_frontend(programs, fanout_label="fake"):
    async def go(url):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, lambda: frontend.run_programs(url, fanout_label, programs, 1000.0))

    return asyncio.run(_with_server(go))


def test_frontend_agent_program_forks_per_tool_call_and_grows_its_transcript():
    """The sgl.function agent, run through RuntimeEndpoint: one note per parallel tool call (forked
    from the transcript so far), one decision per step whose prompt holds every tool result so far,
    and the transcript's cached tokens are read back from meta_info."""
    w = AgentWorkload(output_min=4, output_max=4, tool_latency_mean_s=0.0,
                      shared_system_prompt=False, seed=0, system_min=5, system_max=5, steps_min=5,
                      steps_max=5, tool_median=5, tool_min=3, tool_max=9)
    prog = agent_programs(w, 1, fanout=2)[0]
    recs, log = _run_frontend([prog])
    rec = recs[0]
    assert rec.error is None, rec.error
    steps = range(len(prog.steps))
    assert set(rec.outputs) == {"plan"} | {f"{v}{k}" for k in steps for v in ("note", "step")}
    assert [len(rec.outputs[f"note{k}"]) for k in steps] == [len(s) for s in prog.steps]
    prompts = [b["text"] for _, b in log if b["sampling_params"].get("max_new_tokens")]
    assert len(prompts) == prog.gen_calls
    prev = prompts[0]  # the plan's prompt: system prompt and task
    assert prog.task in prev
    for step in prog.steps:
        for r in step:  # each call's note: the transcript so far, then its own result only
            assert any(p.startswith(prev) and r in p and not any(o in p for o in step if o != r)
                       for p in prompts)
        # the decision: the transcript so far, then every result of the step
        prev = min((p for p in prompts if p.startswith(prev) and all(r in p for r in step)),
                   key=len)
    assert all(r in prev for step in prog.steps for r in step)  # the transcript kept every result
    assert rec.cached_tokens > 0 and frontend.summarize(recs)["cache_hit_rate"] > 0


def test_frontend_summary_counts_errors_and_latency_percentiles():
    """Program summaries: errors counted apart, latency percentiles over the programs that
    finished."""
    recs = [frontend.ProgramRecord("a", "s", latency=1.0, gen_calls=3, prompt_tokens=10,
                                   cached_tokens=5),
            frontend.ProgramRecord("b", "s", latency=3.0, gen_calls=3, prompt_tokens=10,
                                   cached_tokens=5),
            frontend.ProgramRecord("c", "s", latency=9.0, error="RuntimeError: x")]
    s = frontend.summarize(recs)
    assert (s["ok"], s["errors"], s["gen_calls"]) == (2, 1, 6)
    assert s["latency_p50"] == pytest.approx(2.0) and s["cache_hit_rate"] == pytest.approx(0.5)
    assert frontend.summarize([r.to_json() for r in recs]) == s


def test_cli_agent_frontend_reports_program_latency_and_identical_outputs(tmp_path):
    """--workload agent-frontend runs the programs against both servers, prints latency ratios and
    whether the greedy outputs matched, and plots P99 program latency against rate."""
    from benchmarks.loadgen import cli

    async def go(url):
        a = cli.build_parser().parse_args(["--server", f"off={url}", "--server", f"on={url}",
                                           "--quick", "--workload", "agent-frontend",
                                           "--rates", "1000", "--out", str(tmp_path)])
        cli._apply_quick(a)
        a.think_mean = 0.0
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, cli.run, a, {"off": url, "on": url})

    results, _ = asyncio.run(_with_server(go))
    lines = cli.report(results, tmp_path)
    assert all(r["summary"]["errors"] == 0 and r["summary"]["ok"] == 4 for r in results["runs"])
    assert any(line.startswith("== ratios on/off")
               and line.endswith("identical greedy outputs: True") for line in lines)
    assert (tmp_path / "p99_program_latency_vs_rate.png").stat().st_size > 0
