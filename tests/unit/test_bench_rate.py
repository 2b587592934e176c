"""The rate sweep's pieces, without SGLang servers: arrivals that scale with the rate, sessions,
the client-side queue, how a point is judged (stable, drained, unanswered requests in the P99),
the JSON summary, the sweep's sessions against a fake streaming server (histories, think times,
requests cut at the deadline), the flush retried until idle, and the error line of a log."""

import asyncio
import json

import pytest
from aiohttp import web

from benchmarks.loadgen.client import RequestRecord
from benchmarks.nodebench import rate_cli, rate_driver, rates
from benchmarks.nodebench.plan import NodePlan
from benchmarks.workloads.sharegpt import Conversation, Turn


def _convs(n, turns=3):
    return [Conversation(f"c{i}", tuple(Turn(f"u{i}-{t}", "a") for t in range(turns)))
            for i in range(n)]


def test_start_times_scale_with_the_rate_and_keep_the_same_sessions():
    """At rate r the start times are the unit-rate arrivals divided by r, within the window, the
    first at 0; a higher rate starts a superset of a lower rate's sessions (same order)."""
    plan = rates.RatePlan(rates=(0.5, 2.0), window_s=40.0)
    slow, fast = rates.start_times(plan, 0.5), rates.start_times(plan, 2.0)
    assert slow[0] == fast[0] == 0.0
    assert all(t < 40.0 for t in slow + fast) and len(fast) > len(slow) > 3
    assert slow == pytest.approx([t * 4 for t in fast[:len(slow)]])
    assert plan.max_sessions() == len(fast)


def test_sessions_are_deterministic_and_short_conversations_are_refused():
    """Same plan, same sessions and think times; session i's think times do not depend on how
    many sessions are built; too few or too short conversations are errors naming the fix."""
    plan = rates.RatePlan(turns=3, think_mean_s=2.0)
    a = rates.build_sessions(plan, NodePlan(), 4, _convs(4))
    b = rates.build_sessions(plan, NodePlan(), 2, _convs(4))
    assert a[:2] == b and a[0].users == ("u0-0", "u0-1", "u0-2")
    assert all(t > 0 for s in a for t in s.think_s)
    none = rates.build_sessions(rates.RatePlan(think_mean_s=0.0, turns=3), NodePlan(), 1,
                                _convs(1))
    assert none[0].think_s == (0.0, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="lower --rates"):
        rates.build_sessions(plan, NodePlan(), 5, _convs(4))
    with pytest.raises(ValueError, match="fewer than 3"):
        rates.build_sessions(plan, NodePlan(), 1, _convs(1, turns=2))


def test_plan_refuses_nonsense():
    """Rates positive and increasing, known systems, positive window."""
    for bad in (dict(rates=()), dict(rates=(0.2, 0.1)), dict(rates=(0.0,)),
                dict(systems=("vllm",)), dict(window_s=0.0), dict(turns=0)):
        with pytest.raises(ValueError):
            rates.RatePlan(**bad)


def _r(t_send, ttft=None, e2e=None, error=None, prompt=10, cached=5):
    return RequestRecord("s", 1, "busy", t_send, ttft=ttft, e2e=e2e, error=error,
                         prompt_tokens=prompt, cached_tokens=cached)


def test_queue_counts_requests_sent_and_not_yet_answered():
    """At t, the queue holds requests with t_send <= t < first token; an unanswered request
    stays in it, an error leaves it when the error arrives."""
    recs = [_r(0.0, ttft=1.5, e2e=2.0), _r(1.0), _r(2.0, e2e=0.5, error="HTTP 503")]
    assert rates.queue_samples(recs, 4.0) == [(0.0, 1), (1.0, 2), (2.0, 2), (3.0, 1)]


def test_judge_point_counts_unanswered_requests_with_their_wait_and_flags_growth():
    """A growing queue (one more waiting request each second, none answered) is not stable and
    not drained, and its P99 is the longest wait up to the end; a flat queue of fast answers is
    stable and drained."""
    window = 20.0
    growing = [_r(float(t)) for t in range(20)]
    bad = rates.judge_point("stock", 1.0, growing, sessions=20, sessions_done=0,
                            window_s=window, end_s=30.0)
    assert not bad.stable and not bad.drained and bad.unanswered == 20
    assert bad.ttft_p99_ms == pytest.approx(29.81e3, rel=1e-3)  # waits 11..30 s
    assert bad.queue_q4 > 1.5 * bad.queue_q2 + 1
    # growth by only 2 requests over the window passes: noise, not a trend
    assert rates.queue_not_growing([(float(t), int(2 * t / 20)) for t in range(20)], window)
    assert rates.queue_not_growing([(float(t), 40) for t in range(20)], window)  # flat, high
    flat = [_r(float(t), ttft=0.2, e2e=0.5) for t in range(20)]
    good = rates.judge_point("stock", 1.0, flat, sessions=20, sessions_done=20, window_s=window,
                             end_s=20.5)
    assert good.stable and good.drained and good.completed == 20 and good.unanswered == 0
    assert good.ttft_p50_ms == pytest.approx(200.0) and good.cached_tokens == 100


def test_an_error_is_neither_an_answer_nor_a_wait():
    """Errored requests leave the TTFT percentiles and count as errors."""
    recs = [_r(0.0, ttft=0.1, e2e=0.2), _r(0.0, e2e=0.1, error="HTTP 503")]
    p = rates.judge_point("swiftcache", 0.5, recs, 2, 1, 10.0, 1.0)
    assert p.errors == 1 and p.completed == 1 and p.ttft_p99_ms == pytest.approx(100.0)
    assert not p.drained


def _point(system, rate, stable=True, drained=True):
    return rates.PointResult(system, rate, 1, 1, 1, 1, 0, 0, 10.0, 20.0, 10, 5, 0.0, 0.0,
                             stable, drained, 1.0)


def test_summary_lists_points_per_system_and_the_highest_sustained_rate():
    """Highest stable rate: the last rate before the first point that was not stable and
    drained; failures are kept with their reason."""
    pts = [_point("stock", 0.1), _point("stock", 0.2, drained=False), _point("stock", 0.4),
           _point("swiftcache", 0.1), _point("swiftcache", 0.2)]
    out = rates.summary_json(pts, {"hicache": "AssertionError: Torch not compiled with CUDA"})
    assert out["systems"]["stock"]["highest_stable_rate"] == 0.1
    assert out["systems"]["swiftcache"]["highest_stable_rate"] == 0.2
    assert set(out["systems"]["stock"]["points"][0]) == {"rate", "p50", "p99", "completed",
                                                          "sent", "stable", "drained"}
    assert out["failed"]["hicache"].startswith("AssertionError")
    assert rates.highest_stable_rate([_point("x", 0.1, stable=False)]) is None


def _fake_server(log, slow_session=None, slow_s=0.0, busy_flushes=0):
    """Chat completions streaming 'm<messages>' (a request whose last message starts with
    `slow_session` waits `slow_s` first); /flush_cache refuses `busy_flushes` times."""
    flushes = {"refused": 0}

    async def chat(request):
        body = await request.json()
        log.append(body)
        if slow_session and body["messages"][-1]["content"].startswith(slow_session):
            await asyncio.sleep(slow_s)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ev = {"choices": [{"delta": {"content": f"m{len(body['messages'])}"}}]}
        usage = {"usage": {"prompt_tokens": 7, "completion_tokens": 1,
                           "prompt_tokens_details": {"cached_tokens": 3}}, "choices": []}
        await resp.write(f"data: {json.dumps(ev)}\n\ndata: {json.dumps(usage)}\n\n"
                         f"data: [DONE]\n\n".encode())
        return resp

    async def flush(request):
        if flushes["refused"] < busy_flushes:
            flushes["refused"] += 1
            return web.Response(status=400, text="Cache not flushed: requests running")
        return web.Response(text="Cache flushed.")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/flush_cache", flush)
    return app, flushes


async def _serve(app):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def test_drive_carries_histories_and_cuts_what_runs_past_the_deadline():
    """Each turn carries the history with the model's answers; a session whose answer does not
    come before the deadline is cut: its request stays in the records without a first token,
    and it does not count as finished."""
    log = []
    sessions = [rates.Session("a", ("a1", "a2", "a3"), (0.0, 0.0, 0.0)),
                rates.Session("b", ("b1", "b2"), (0.0, 0.0))]

    async def main():
        app, _ = _fake_server(log, slow_session="b2", slow_s=5.0)
        runner, url = await _serve(app)
        try:
            return await rate_driver._drive(url, sessions, [0.0, 0.05], 4, deadline_s=1.0)
        finally:
            await runner.cleanup()

    records, finished, end_s = asyncio.run(main())
    assert finished == 1 and 1.0 <= end_s < 3.0
    a = [b["messages"] for b in log if b["messages"][0]["content"] == "a1"]
    assert [len(m) for m in a] == [1, 3, 5] and a[2][3] == {"role": "assistant", "content": "m3"}
    cut = [r for r in records if r.session == "b" and r.turn == 2]
    assert len(cut) == 1 and cut[0].ttft is None and cut[0].error is None
    assert all(r.ttft is not None and r.cached_tokens == 3 for r in records if r is not cut[0])


def test_flush_is_retried_until_the_server_is_idle():
    """SGLang refuses /flush_cache while requests run: the sweep retries until it succeeds."""
    import aiohttp

    async def main():
        app, flushes = _fake_server([], busy_flushes=2)
        runner, url = await _serve(app)
        try:
            async with aiohttp.ClientSession() as http:
                await rate_driver._flush_when_idle(http, url)
            return flushes["refused"]
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == 2


def test_last_error_line_names_what_stopped_a_server():
    """The last exception line of a server log (here HiCache on the CPU engine)."""
    log = ("[2026-11-30] Scheduler hit an exception: Traceback (most recent call last):\n"
           '  File "torch/cuda/__init__.py", line 522, in _lazy_init\n'
           "AssertionError: Torch not compiled with CUDA enabled\n\n"
           "[2026-11-30] Received sigquit from a child process.\n")
    assert rate_cli.last_error_line(log) == "AssertionError: Torch not compiled with CUDA enabled"
    assert rate_cli.last_error_line("just a line\n") == "just a line"


def test_the_sweep_systems_map_to_the_node_benchmark_runs():
    """stock and hicache use stock pools, swiftcache borrows, ideal moves the lendable share
    (512 busy tokens, 2048 donor tokens) into the busy pool for good."""
    from benchmarks.nodebench.plan import ModelFacts
    from tests.unit.test_node_bench import SMALL, TINY

    node = NodePlan()
    busy, donor = ModelFacts.from_config("small", SMALL), ModelFacts.from_config("tiny", TINY)
    ideal = rate_driver.run_spec("ideal", node, busy, donor)
    assert (ideal.busy_pool, ideal.donor_pool, ideal.swiftcache) == (1536, 2048, False)
    assert rate_driver.run_spec("swiftcache", node, busy, donor).swiftcache
    assert rate_driver.run_spec("hicache", node, busy, donor).busy_pool == 1024


class _FakeServer:
    def __init__(self, fail=False):
        self.fail, self.started, self.stopped = fail, False, False

    def start(self):
        if self.fail:
            from benchmarks.tools.local_server import ServerStartError
            raise ServerStartError("server exited with code 1:\nAssertionError: no CUDA")
        self.started = True

    def stop(self):
        self.stopped = True


def test_a_system_that_cannot_start_is_recorded_and_its_servers_stopped(tmp_path):
    """Node.start keeps a start-up failure as the node's error (the sweep goes on with the other
    systems) and stops both of its servers, including the one that did start."""
    busy, donor = _FakeServer(fail=True), _FakeServer()
    node = rate_driver.Node("hicache", None, busy, donor, str(tmp_path / "rdv"))
    node.start()
    assert "AssertionError: no CUDA" in node.error
    assert donor.started and donor.stopped and busy.stopped


def test_the_plot_is_written_with_a_load_panel(tmp_path):
    """The plot file is written for points of two systems, an unstable one included."""
    pts = [_point("stock", 0.5), _point("stock", 1.0, stable=False),
           _point("swiftcache", 0.5), _point("swiftcache", 1.0)]
    for p in pts:
        p.extra = {"loadavg_1min": [3.0, 4.0]}
    out = tmp_path / "img" / "curves.png"
    rate_cli.plot_curves(out, pts, "t")
    assert out.stat().st_size > 10_000


def test_replot_redraws_from_the_saved_json(tmp_path):
    """--replot reads the points a sweep saved (PointResult.to_json) and draws them again."""
    pts = [_point("stock", 0.5), _point("swiftcache", 0.5)]
    detail = {"summary": {"date": "2026-11-30"}, "busy_model": "small-llama",
              "points": [p.to_json() for p in pts]}
    (tmp_path / "rate_curves.json").write_text(json.dumps(detail))
    assert rate_cli.main(["--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "rate_curves.png").stat().st_size > 10_000
