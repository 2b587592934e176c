"""The node benchmark's pieces, without SGLang servers: sizes and FLOPs per KV byte, the runs'
arguments, Prometheus parsing, burst prompts, the traffic phases against a fake streaming server,
the burst rounds, output comparison, the reclaim view and the JSON summary's keys."""

import asyncio
import contextlib
import http.server
import json
import threading
import time

import pytest
from aiohttp import web

from benchmarks.loadgen.client import RequestRecord
from benchmarks.nodebench import cli, observe, plan, report, runner, traffic
from benchmarks.workloads.sharegpt import Conversation, Turn


@contextlib.contextmanager
def _http_server(handler):
    """An http.server fake on a free port (threads), quiet; yields its base URL."""
    handler.log_message = lambda *args: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()

SMALL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=2048,
             dtype="float32")
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=2048, dtype="float32")


def test_model_facts_kv_bytes_and_flops_per_kv_byte():
    """KV bytes per token = 2 x layers x kv_heads x head_dim x dtype bytes; matmul FLOPs per
    token = 2 x (per-layer q, k, v, o, gate/up/down weights + lm_head), worked out by hand."""
    small = plan.ModelFacts.from_config("small", SMALL)
    assert small.kv_bytes_per_token == 8192
    per_layer = 512 * 256 + 2 * 512 * 128 + 256 * 512 + 3 * 512 * 1408
    assert small.matmul_flops_per_token == 2 * (8 * per_layer + 512 * 2048)
    assert small.flops_per_kv_byte == pytest.approx(5250, rel=0.01)
    tiny = plan.ModelFacts.from_config("tiny", TINY)  # head_dim from hidden / heads
    assert tiny.kv_bytes_per_token == 2048
    assert tiny.attn_flops_per_context_token == 4 * 4 * 4 * 32
    with pytest.raises(ValueError, match="dtype"):
        plan.ModelFacts.from_config("x", {**TINY, "dtype": "int3"})


def test_plan_sizes_and_the_equal_memory_rule():
    """Both default pools hold the same bytes, and the donor's lendable half is worth 512 busy
    tokens; nonsense sizes are refused."""
    p = plan.NodePlan()
    busy = plan.ModelFacts.from_config("small", SMALL)
    donor = plan.ModelFacts.from_config("tiny", TINY)
    assert p.busy_pool * busy.kv_bytes_per_token == p.donor_pool * donor.kv_bytes_per_token
    assert p.lendable_busy_tokens(busy, donor) == 512
    assert p.burst_tokens_each * p.burst_requests <= p.donor_pool * p.burst_fraction
    assert plan.NodePlan.quick().busy_requests < p.busy_requests
    for bad in (dict(turns=0), dict(lend_fraction=1.0), dict(burst_fraction=0)):
        with pytest.raises(ValueError):
            plan.NodePlan(**bad)


def test_three_runs_hold_the_same_memory_and_only_b_runs_swiftcache():
    """(a) has (b)'s pools; (c) moves what (b) lent (donor tokens out, busy tokens in); only (b)
    passes SwiftCache options, with the borrower and donor roles on the right servers."""
    p = plan.NodePlan()
    a, b, c = plan.stock_run(p), plan.swiftcache_run(p), plan.ideal_run(p, 508, 2048)
    assert (a.busy_pool, a.donor_pool) == (b.busy_pool, b.donor_pool) == (1024, 4096)
    assert (c.busy_pool, c.donor_pool) == (1024 + 508, 4096 - 2048)
    for spec in (a, c):
        args = spec.busy_args(p, "/rv", 512) + spec.donor_args(p, "/rv")
        assert not [x for x in args if x.startswith("--swiftcache")]
    busy = b.busy_args(p, "/rv", 512)
    donor = b.donor_args(p, "/rv")
    assert busy[busy.index("--swiftcache-role") + 1] == "borrower"
    assert busy[busy.index("--swiftcache-max-borrow-blocks") + 1] == "512"
    assert donor[donor.index("--swiftcache-role") + 1] == "donor"
    assert donor[donor.index("--swiftcache-lend-fraction") + 1] == "0.5"
    assert "--enable-metrics" in busy and "--enable-metrics" in a.busy_args(p, "/rv", 0)
    with pytest.raises(ValueError, match="out of range"):
        plan.ideal_run(p, 10, 4096)


def test_parse_metrics_sums_label_sets_and_skips_absent_names():
    """A metric's samples are summed over labels; comments and other metrics are ignored; a name
    with no sample is absent (a stock server), not zero."""
    text = "\n".join([
        "# HELP swiftcache_usable_tokens usable", "# TYPE swiftcache_usable_tokens gauge",
        'swiftcache_usable_tokens{agent="d",role="donor"} 2048.0',
        'swiftcache_lent_tokens{agent="d",role="donor"} 1024.0',
        'swiftcache_lent_tokens{agent="e",role="donor"} 1024.0',
        'swiftcache_reclaim_latency_seconds_bucket{le="0.1"} 1.0',
        'swiftcache_reclaim_latency_seconds_sum{agent="d"} 0.042',
        'swiftcache_reclaim_latency_seconds_count{agent="d"} 1.0',
        'sglang:num_running_reqs{model="m"} 3.0'])
    got = observe.parse_metrics(text)
    assert got == {"swiftcache_usable_tokens": 2048.0, "swiftcache_lent_tokens": 2048.0,
                   "swiftcache_reclaim_latency_seconds_sum": 0.042,
                   "swiftcache_reclaim_latency_seconds_count": 1.0}
    assert observe.parse_metrics("sglang:x 1\n") == {}


class _Tok:
    """A whitespace tokenizer with the `tokenizers` encode() surface (ids, char offsets)."""

    def encode(self, text):
        import re

        spans = [m.span() for m in re.finditer(r"\S+", text)]

        class Enc:
            ids = list(range(len(spans)))
            offsets = spans
        return Enc()


def test_long_messages_cut_at_the_nth_token_one_per_conversation():
    """Burst prompts: the first message of >= n tokens per conversation, in order, cut right
    after its n-th token, skipping excluded conversations; too few is an error naming the fix."""
    convs = [Conversation("x", (Turn("a b c d e f", "."),)),
             Conversation("y", (Turn("short", "."), Turn("one two three four", "."),
                                Turn("p q r s t", "."))),
             Conversation("z", (Turn("u v w x", "."),))]
    got = traffic.long_messages(convs, {"x"}, _Tok(), 3, 2)
    assert got == ["one two three", "u v w"]
    with pytest.raises(RuntimeError, match="burst"):
        traffic.long_messages(convs, {"x"}, _Tok(), 5, 2)


def _fake_chat_app(arrivals):
    """Streams two content pieces naming the request's message count; usage reports prompt
    tokens = characters of all messages and cached = 1."""

    async def chat(request):
        body = await request.json()
        arrivals.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = len(body["messages"])
        for piece in (f"m{n}", "."):
            ev = {"choices": [{"delta": {"content": piece}}]}
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        chars = sum(len(m["content"]) for m in body["messages"])
        usage = {"usage": {"prompt_tokens": chars, "completion_tokens": 2,
                           "prompt_tokens_details": {"cached_tokens": 1}}, "choices": []}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def generate(request):  # one batched call of token ids: every prompt streams
        body = await request.json()
        arrivals.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n in (1, 2):  # cumulative text, interleaved across the prompts
            for i, ids in enumerate(body["input_ids"]):
                meta = {"completion_tokens": n, "prompt_tokens": len(ids), "cached_tokens": 1}
                ev = {"index": i, "text": f"g{len(ids)}" + "." * (n - 1), "meta_info": meta}
                await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/generate", generate)
    return app


async def _fake_servers(*logs):
    """One fake streaming server per arrivals list; returns (runners, base URLs)."""
    runners, urls = [], []
    for log in logs:
        r = web.AppRunner(_fake_chat_app(log))
        await r.setup()
        site = web.TCPSite(r, "127.0.0.1", 0)
        await site.start()
        runners.append(r)
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    return runners, urls


def test_steady_phase_then_bursts_then_the_next_busy_turn_continue_the_histories():
    """Steady phase: busy turns round-robin with growing histories (the model's answers
    included) and the donor's light turns alternating its conversations, side by side. A burst
    is one batched /generate of token ids (so its requests reach the donor's scheduler together
    in every run), its records named by round; the reclaim-phase turn continues each busy
    history; marks are in order."""
    busy = tuple(Conversation(f"b{i}", tuple(Turn(f"u{i}{t}", ".") for t in range(3)))
                 for i in range(2))
    donor = tuple(Conversation(f"d{i}", tuple(Turn(f"v{i}{t}", ".") for t in range(2)))
                  for i in range(2))
    tr = traffic.Traffic(busy, donor, ((1, 2, 3), (4, 5)))
    p = plan.NodePlan(conversations=2, turns=2, donor_conversations=2, donor_requests=3,
                      donor_interval_s=0.0, burst_requests=2)
    arrivals_busy, arrivals_donor = [], []

    async def main():
        runners, (busy_url, donor_url) = await _fake_servers(arrivals_busy, arrivals_donor)
        marks = traffic.Marks(t0=time.perf_counter())
        replay = traffic.BusyReplay(busy_url, tr, p, marks.t0)
        try:
            records = await traffic.steady(busy_url, donor_url, tr, p, replay, marks)
            async with traffic.session() as http:
                records["burst"] = [
                    *await traffic.burst(http, donor_url, tr, p, marks, 0),
                    *await traffic.burst(http, donor_url, tr, p, marks, 1)]
                records["busy_reclaim"] = await replay.turns(http, p.turns, p.turns + 1)
            marks.traffic_end = marks.now()
            return records, marks
        finally:
            for r in runners:
                await r.cleanup()

    records, marks = asyncio.run(main())
    assert [(r.session, r.turn) for r in records["busy"]] == [
        ("b0", 1), ("b1", 1), ("b0", 2), ("b1", 2)]
    assert [(r.session, r.turn) for r in records["busy_reclaim"]] == [("b0", 3), ("b1", 3)]
    assert [len(b["messages"]) for b in arrivals_busy] == [1, 1, 3, 3, 5, 5]
    assert arrivals_busy[2]["messages"][1] == {"role": "assistant", "content": "m1."}
    assert [(r.session, r.turn) for r in records["donor"]] == [("d0", 1), ("d1", 1), ("d0", 2)]
    assert [(r.session, r.turn) for r in records["burst"]] == [
        ("burst-0", 1), ("burst-1", 1), ("burst-0", 2), ("burst-1", 2)]
    batched = [b for b in arrivals_donor if "input_ids" in b]
    assert [b["input_ids"] for b in batched] == [[[1, 2, 3], [4, 5]]] * 2
    assert len(arrivals_donor) == 5
    assert [(r.text, r.prompt_tokens, r.completion_tokens) for r in records["burst"][:2]] == [
        ("g3.", 3, 2), ("g2.", 2, 2)]
    assert all(r.cached_tokens == 1 and r.ttft is not None for s in records.values() for r in s)
    steady_end = max(r.t_send + r.e2e for r in records["busy"] + records["donor"])
    assert marks.steady_end >= steady_end
    (s0, e0), (s1, e1) = marks.bursts
    assert marks.steady_end <= s0 <= e0 <= s1 <= e1 <= marks.traffic_end
    assert all(r.t_send >= e1 for r in records["busy_reclaim"])


def test_rounds_rotate_the_runs_order():
    """No run's burst always goes first (or last) in its round."""
    keys = ["a", "b", "c"]
    orders = [traffic.round_order(keys, r) for r in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert {o[0] for o in orders[:3]} == set(keys)


def test_flush_donors_flushes_each_once_it_is_idle():
    """Between rounds every donor's /flush_cache is posted, and retried while SGLang answers
    that the server is busy."""
    hits: list[tuple[int, str]] = []

    def handler(busy_answers):
        left = [busy_answers]

        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                hits.append((self.server.server_port, self.path))
                ok = left[0] == 0
                left[0] = max(0, left[0] - 1)
                self.send_response(200 if ok else 400)
                self.end_headers()
                self.wfile.write(b"ok" if ok else b"not idle")

        return H

    with _http_server(handler(0)) as u0, _http_server(handler(2)) as u1:
        asyncio.run(traffic.flush_donors([u0, u1]))
    ports = [int(u.rsplit(":", 1)[1]) for u in (u0, u1)]
    assert hits == [(ports[0], "/flush_cache")] + [(ports[1], "/flush_cache")] * 3


def test_thread_cpu_readings_name_the_threads_of_a_process_tree_that_did_the_work(tmp_path):
    """--diagnose's CPU readings: every thread of the root process and its children, keyed
    process/thread/tid; the difference of two readings is the CPU each thread spent between
    them (the child's spinning thread shows; the idle root does not)."""
    import subprocess
    import sys

    import psutil

    go = tmp_path / "go"
    (tmp_path / "child.py").write_text(
        "import os, sys, time\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\n"
        "time.sleep(30)\n")
    (tmp_path / "root.py").write_text(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]])\n"
        "time.sleep(30)\n")
    root = subprocess.Popen([sys.executable, str(tmp_path / "root.py"),
                             str(tmp_path / "child.py"), str(go)])
    try:
        deadline = time.monotonic() + 20
        while len(psutil.Process(root.pid).children()) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        before = observe.thread_cpu_s(root.pid)
        go.touch()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            delta = observe.cpu_delta(before, observe.thread_cpu_s(root.pid))
            if max(delta.values()) >= 0.25:
                break
            time.sleep(0.05)
    finally:
        for proc in psutil.Process(root.pid).children(recursive=True):
            proc.kill()
        root.kill()
        root.wait()
    top, spent = next(iter(delta.items()))
    assert spent >= 0.25 and top.count("/") == 2
    assert int(top.rsplit("/", 1)[1]) != root.pid  # the child's thread, not the idle root
    assert observe.cpu_delta({"a": 1.0}, {"a": 1.5, "b": 2.0}) == {"b": 2.0, "a": 0.5}


def _rec(session, turn, text, ttft=0.1, cached=0, prompt=10, ids=None):
    """A record whose output ids are its text's letters' codes unless `ids` says."""
    return RequestRecord(session=session, turn=turn, server="x", t_send=0.0, ttft=ttft,
                         cached_tokens=cached, prompt_tokens=prompt, text=text,
                         output_ids=[ord(c) for c in text] if ids is None else ids)


def test_compare_outputs_counts_changed_and_missing_requests():
    """A request whose token ids differ, or which the other run lacks, is a mismatch."""
    base = {"busy": [_rec("c", 1, "x"), _rec("c", 2, "y")], "donor": [_rec("d", 1, "z")],
            "burst": []}
    same = {"busy": [_rec("c", 2, "y"), _rec("c", 1, "x")], "donor": [_rec("d", 1, "z")]}
    assert report.compare_outputs(base, same)["matched"] == 3
    other = {"busy": [_rec("c", 1, "x"), _rec("c", 2, "Y")], "donor": []}
    got = report.compare_outputs(base, other)
    assert got["matched"] == 1 and got["mismatches"] == [["busy", "c", 2], ["donor", "d", 1]]


def test_compare_outputs_is_on_token_ids_and_two_empty_outputs_do_not_match():
    """Equal text from other ids differs; two empty answers (refused, failed) compare nothing."""
    base = {"busy": [_rec("c", 1, "x", ids=[5]), _rec("c", 2, "", ids=[])]}
    other = {"busy": [_rec("c", 1, "x", ids=[6]), _rec("c", 2, "", ids=[])]}
    got = report.compare_outputs(base, other)
    assert got["matched"] == 0 and got["mismatches"] == [["busy", "c", 1], ["busy", "c", 2]]
    assert report.same_output([1, 2], (1, 2)) and not report.same_output([], [])


class _FakeSampler(observe.CapacitySampler):
    def __init__(self, samples):
        self.samples = samples


def test_reclaim_view_needs_lent_pages_at_each_burst_and_a_full_pool_after_each():
    """`reclaimed` is true only when pages were lent when every burst began and, before the
    next burst, a sample shows the donor's whole pool usable again or its reclaim counter shows
    the round's reclaim completed (its last lent page back)."""
    g = lambda lent: {"swiftcache_kv_pool_tokens": 4096.0,  # noqa: E731
                      "swiftcache_lent_tokens": lent, "swiftcache_usable_tokens": 4096.0 - lent}
    two = [(0.0, g(2048)), (5.0, g(2048)), (6.0, g(0)), (9.0, g(2048)), (12.0, g(0))]
    view = report.reclaim_view(_FakeSampler({"donor": two}), [(5.5, 5.7), (10.0, 10.2)])
    assert view["rounds"] == [{"lent_at_burst": 2048, "full_after_s": 0.5},
                              {"lent_at_burst": 2048, "full_after_s": 2.0}]
    assert view["lent_at_burst"] == 2048 and view["full_after_burst"]
    assert view["full_after_s"] == 2.0  # the slowest round
    tables = {k: report.run_tables({"busy": [_rec("c", 1, "x")]}) for k in "abc"}
    outputs = {k: {"matched": 1, "compared": 1} for k in "abc"}
    assert report.summarize(tables, outputs, view, None)["reclaimed"] is True
    # the pool came back only after the second burst: the first round's full sample is missing
    late = [(0.0, g(2048)), (5.0, g(2048)), (9.0, g(2048)), (12.0, g(0))]
    view = report.reclaim_view(_FakeSampler({"donor": late}), [(5.5, 5.7), (10.0, 10.2)])
    assert view["rounds"][0]["full_after_s"] is None and not view["full_after_burst"]
    assert report.summarize(tables, outputs, view, None)["reclaimed"] is False
    never = _FakeSampler({"donor": [(0.0, g(2048)), (6.0, g(2048))]})
    assert not report.reclaim_view(never, [(5.5, 5.7)])["full_after_burst"]
    # nothing lent at the second burst: that round reclaimed nothing
    unlent = [(0.0, g(2048)), (6.0, g(0)), (9.0, g(0)), (12.0, g(0))]
    view = report.reclaim_view(_FakeSampler({"donor": unlent}), [(5.5, 5.7), (10.0, 10.2)])
    assert view["full_after_burst"] and view["rounds"][1]["lent_at_burst"] == 0
    assert report.summarize(tables, outputs, view, None)["reclaimed"] is False
    assert report.reclaim_view(never, [])["rounds"] == []
    # no sample caught the first round's full pool, but the reclaim counter did: reclaimed
    view = report.reclaim_view(_FakeSampler({"donor": late}), [(5.5, 5.7), (10.0, 10.2)],
                               [1.0, 1.0])
    assert view["rounds"][0] == {"lent_at_burst": 2048, "full_after_s": None, "reclaims": 1.0}
    assert view["full_after_burst"] and view["full_after_s"] == 2.0
    assert report.summarize(tables, outputs, view, None)["reclaimed"] is True
    # neither: the round's reclaim did not complete before the next reading
    view = report.reclaim_view(_FakeSampler({"donor": late}), [(5.5, 5.7), (10.0, 10.2)],
                               [0.0, None])
    assert not view["full_after_burst"]


def test_summary_keys_are_the_stated_ratios():
    """Each ratio key is exactly (b)/(a) or (b)/(c) of the named figure; `identical` is false as
    soon as one output of (b) or (c) differs from (a)'s."""
    def tables(cached, ttft_ms, donor_ms):
        busy = [_rec("c", 1, "x", ttft=ttft_ms / 1e3, cached=cached)]
        donor = [_rec("d", 1, "y", ttft=donor_ms / 1e3)]
        return report.run_tables({"busy": busy, "donor": donor, "burst": []})

    t = {"a": tables(100, 50, 10), "b": tables(300, 40, 11), "c": tables(320, 80, 9)}
    ok = {k: {"matched": 2, "compared": 2} for k in "abc"}
    view = {"lent_at_burst": 2048, "full_after_burst": True,
            "rounds": [{"lent_at_burst": 2048, "full_after_s": 0.5}]}
    s = report.summarize(t, ok, view, 0.01)
    assert s["identical"] is True and s["reclaimed"] is True
    assert s["busy_cached_ratio"] == 3.0 and s["busy_cached_vs_ideal"] == pytest.approx(0.938)
    assert s["busy_ttft_p99_ratio"] == 0.8 and s["busy_ttft_p99_vs_ideal"] == 0.5
    assert s["donor_ttft_p99_ratio"] == 1.1
    bad = dict(ok, c={"matched": 1, "compared": 2})
    assert report.summarize(t, bad, view, 0.01)["identical"] is False
    assert report.ratio(1.0, 0) is None


def test_alerts_pick_errors_not_routine_stats():
    """Server log lines reported are tracebacks, errors and lost donor memory; not stats lines,
    nor SGLang's harmless freeze_gc traceback at start-up."""
    log = "\n".join(["[t] post-warmup freeze_gc failed", "Traceback (most recent call last):",
                     "  File x", "ConnectionRefusedError: [Errno 111] Connection refused",
                     "[t] SwiftCache stats: {'refused_loads': 0, 'lost_leases': 0}",
                     "[t] Scheduler hit an exception: Traceback (most recent call last):",
                     "  File y",
                     "[t] ERROR something broke",
                     "[t] SwiftCache: lease k lost (peer timeout); prefixes will be recomputed"])
    assert len(runner.alerts_in(log)) == 3


def test_cli_quick_and_overrides():
    """--quick picks the quick plan; an override replaces one field; an invalid one is a usage
    error that names it."""
    args, p = cli.parse_args(["--quick", "--turns", "3"])
    assert args.quick and p.turns == 3 and p.donor_requests == plan.NodePlan.quick().donor_requests
    with pytest.raises(SystemExit):
        cli.parse_args(["--lend-fraction", "1.5"])


def test_burst_rounds_in_trace_are_the_trailing_prefills_that_add_up_round_by_round():
    from benchmarks.nodebench.report import burst_rounds_in_trace, burst_split

    def ext(n, wall=10.0):
        return {"mode": "EXTEND", "new_tokens": n, "wall_ms": wall, "cpu_ms": wall - 1}

    dec = {"mode": "DECODE", "new_tokens": 6, "wall_ms": 5.0, "cpu_ms": 5.0}
    # light traffic, then round 1 (one pass), then round 2 split by a decode (partial admission)
    trace = [ext(300), dec, ext(1000, 70.0), dec, dec, ext(600, 50.0), dec, ext(400, 30.0),
             dec, dec]
    r1, r2 = burst_rounds_in_trace(trace, [1000, 1000])
    assert [f["new_tokens"] for f in r1] == [1000]
    assert [f["new_tokens"] for f in r2] == [600, 400]  # in trace order, decodes skipped
    # 400 + 600 overshoots 900: not the burst, and nothing before it is trusted
    assert burst_rounds_in_trace(trace, [1000, 900]) == [[], []]
    assert burst_rounds_in_trace(trace, [5000, 1000]) == [[], r2]  # the trace ran out
    assert burst_rounds_in_trace([dec, dec], [10]) == [[]]
    split = burst_split(120.0, r2)
    assert split == {"ttft_ms": 120.0, "forwards": 2, "forward_wall_ms": 80.0,
                     "forward_cpu_ms": 78.0, "outside_ms": 40.0}
    assert burst_split(None, r2) is None and burst_split(120.0, []) is None


def test_sampler_can_watch_again_after_it_stopped():
    """The SwiftCache run's sampler watches its steady phase, stops while the other runs serve
    theirs, and watches again for the bursts: both periods land in one series."""
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"swiftcache_lent_tokens 7\n")

    with _http_server(H) as url:
        sampler = observe.CapacitySampler({"donor": url}, 0.05, time.perf_counter())
        with sampler:
            time.sleep(0.2)
        first = len(sampler.series("donor", "swiftcache_lent_tokens"))
        time.sleep(0.3)
        assert len(sampler.series("donor", "swiftcache_lent_tokens")) == first  # stopped
        with sampler:
            time.sleep(0.2)
    pts = sampler.series("donor", "swiftcache_lent_tokens")
    assert first >= 1 and len(pts) > first and all(v == 7 for _, v in pts)
    gap = max(b - a for (a, _), (b, _) in zip(pts, pts[1:]))
    assert gap >= 0.3  # the stopped period shows as a gap, not as samples


def test_warm_up_donor_runs_the_bursts_shape_then_flushes_once_the_server_is_idle():
    from benchmarks.nodebench.traffic import Traffic, warm_up_donor

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n)
            seen.append((self.path, json.loads(body) if body else None))
            busy = self.path == "/flush_cache" and \
                sum(p == "/flush_cache" for p, _ in seen) == 1  # not idle yet, the first time
            self.send_response(400 if busy else 200)
            self.end_headers()
            self.wfile.write(b"{}")

    with _http_server(Handler) as url:
        warm_up_donor(url, Traffic(busy=(), donor=(), burst=((1, 2, 3), (4, 5, 6, 7))))
    assert [p for p, _ in seen] == ["/generate", "/flush_cache", "/flush_cache"]
    gen = seen[0][1]
    assert gen["input_ids"] == [[2, 3, 1], [5, 6, 7, 4]]  # the burst's shape, not its prompts
    assert gen["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}


def test_burst_noise_rounds_visit_every_server_in_rotated_order_and_flush_between(monkeypatch):
    """scripts/burst_noise.py's rounds: each round one burst per server, in round_order, every
    server flushed after the round; the TTFT recorded is the burst's slowest request's."""
    from benchmarks.nodebench import burst_noise

    calls: list[str] = []

    async def fake_burst(http, url, tr, p):
        calls.append(url)
        return float(len(calls))

    async def fake_flush(urls):
        calls.append("flush " + ",".join(urls))

    monkeypatch.setattr(burst_noise, "_burst_ms", fake_burst)
    monkeypatch.setattr(burst_noise, "flush_donors", fake_flush)
    got = burst_noise._rounds({"s0": "u0", "s1": "u1"}, None, plan.NodePlan.quick(), 2)
    assert calls == ["u0", "u1", "flush u0,u1", "u1", "u0", "flush u0,u1"]
    assert got == {"s0": [1.0, 5.0], "s1": [2.0, 4.0]}
    with pytest.raises(SystemExit):
        burst_noise.main(["--servers", "0"])


def test_wait_lent_does_not_take_the_gauge_from_before_the_reclaim():
    """Between rounds the SwiftCache donor's lent gauge can still show the loan from before the
    last burst (gauges are updated once a second): wait_lent goes on only once the reclaim count
    shows that burst's reclaim and the loan is back, and the busy server holds a lease."""
    from types import SimpleNamespace

    donor_readings = [(2048, 1), (0, 2), (0, 2), (2048, 2)]  # stale, reclaimed, relent
    seen = {"donor": 0, "busy": 0}

    def handler(role):
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                k = seen[role]
                seen[role] += 1
                if role == "donor":
                    lent, count = donor_readings[min(k, len(donor_readings) - 1)]
                    body = (f"swiftcache_lent_tokens {lent}\n"
                            f"swiftcache_reclaim_latency_seconds_count {count}\n")
                else:
                    body = f"swiftcache_borrowed_tokens {0 if k == 0 else 512}\n"
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body.encode())

        return H

    with _http_server(handler("donor")) as d, _http_server(handler("busy")) as b:
        node = SimpleNamespace(donor=SimpleNamespace(base_url=d), busy=SimpleNamespace(base_url=b))
        assert runner.Node.wait_lent(node, 2048, 2, timeout_s=30) is True
    assert seen == {"donor": 4, "busy": 2}
    with _http_server(handler("donor")) as d, _http_server(handler("busy")) as b:
        node = SimpleNamespace(donor=SimpleNamespace(base_url=d), busy=SimpleNamespace(base_url=b))
        assert runner.Node.wait_lent(node, 2048, 3, timeout_s=0.6) is False  # never 3 reclaims


def test_burst_rounds_flush_wait_for_the_loan_and_keep_the_sampler_off_the_bursts(monkeypatch):
    """Each round sends every run's burst in round_order; in every round but the last, each
    donor is flushed after its burst, and after the SwiftCache donor's the run waits for its
    loan (reclaims counted from the count before the first round) with its sampler on, before
    any other burst; no burst goes while it samples. The SwiftCache donor's wait counter is read
    before each round, never during a burst: the differences are each round's wait for lent
    pages."""
    from types import SimpleNamespace

    log: list = []

    class Sampler:
        on = False

        def __enter__(self):
            Sampler.on = True
            log.append("sample")

        def __exit__(self, *exc):
            Sampler.on = False

    def node(key, swift):
        async def burst(http, r):
            assert not Sampler.on
            log.append((key, r))

        def wait_lent(tokens, reclaims):
            assert Sampler.on
            log.append(("wait", tokens, reclaims))
            return True

        return SimpleNamespace(spec=SimpleNamespace(key=key, swiftcache=swift),
                               donor=SimpleNamespace(base_url=f"u{key}"), burst=burst,
                               wait_lent=wait_lent, sampler=Sampler(), diagnose=False,
                               plan=plan.NodePlan(burst_rounds=3))

    async def flush(http, url):
        log.append(("flush", url))

    @contextlib.asynccontextmanager
    async def session():
        yield None

    waited = iter([0.0, 0.05, 0.056])

    def scrape(url):
        assert url == "ub" and not Sampler.on
        log.append("read")
        return {runner.OWN_WAIT: next(waited)}

    monkeypatch.setattr(runner, "flush_donor", flush)
    monkeypatch.setattr(runner, "session", session)
    monkeypatch.setattr(runner, "scrape", scrape)
    nodes = {k: node(k, k == "b") for k in "abc"}
    cpu, readings = runner._burst_rounds(nodes, nodes["b"], 2048.0, 4.0, lambda line: None)
    assert cpu == [] and [m[runner.OWN_WAIT] for m in readings] == [0.0, 0.05, 0.056]
    assert log == ["read", ("a", 0), ("flush", "ua"), ("b", 0), ("flush", "ub"),
                   "sample", ("wait", 2048.0, 5.0), ("c", 0), ("flush", "uc"),
                   "read", ("b", 1), ("flush", "ub"), "sample", ("wait", 2048.0, 6.0),
                   ("c", 1), ("flush", "uc"), ("a", 1), ("flush", "ua"),
                   "read", ("c", 2), ("a", 2), ("b", 2)]  # the last round: no flush, no wait
    counts = [{runner.RECLAIMS: c} for c in (4.0, 5.0, 6.0, 7.0)]
    assert runner.per_round(counts, runner.RECLAIMS) == [1.0, 1.0, 1.0]
    assert runner.per_round([counts[0], None, {}], runner.RECLAIMS) == [None, None]


def test_burst_cpu_means_per_run_and_server(tmp_path):
    """--diagnose: the CPU ms every server spent during each run's bursts, averaged over the
    rounds, read back from OUT/burst-cpu.json."""
    rows = [{"round": 1, "run": "a", "cpu_ms": {"a-donor": 100.0, "b-busy": 1.0}},
            {"round": 1, "run": "b", "cpu_ms": {"a-donor": 0.0, "b-busy": 30.0}},
            {"round": 2, "run": "a", "cpu_ms": {"a-donor": 120.0, "b-busy": 3.0}}]
    (tmp_path / "burst-cpu.json").write_text(json.dumps(rows))
    assert cli._burst_cpu(tmp_path) == {"a": {"a-donor": 110.0, "b-busy": 2.0},
                                        "b": {"a-donor": 0.0, "b-busy": 30.0}}
    assert cli._burst_cpu(tmp_path / "missing") == {}


def test_planned_loan_is_what_an_idle_donor_lends_packed_into_busy_tokens():
    """The ideal run is sized before (b) runs: the donor lends its lend fraction (2048 of 4096
    tokens), or less when its room above the reserve (20%) and the headroom (1/16) is smaller;
    the lent bytes packed into busy tokens (4 donor tokens of 2 KiB per 8 KiB busy token),
    capped by the borrower's limit."""
    busy = plan.ModelFacts.from_config("small", SMALL)
    donor = plan.ModelFacts.from_config("tiny", TINY)
    p = plan.NodePlan()
    assert p.lent_donor_tokens == 2048
    assert p.planned_loan(busy, donor) == (512, 2048)
    greedy = plan.NodePlan(lend_fraction=0.9)  # room: 4096 - 819 - 256 = 3021 tokens
    assert greedy.lent_donor_tokens == 3021
    assert greedy.planned_loan(busy, donor) == (755, 3021)


def test_check_ideal_refuses_an_ideal_run_that_does_not_hold_what_b_moved():
    """(c) is started with the others from the planned loan; if (b)'s peaks differ, the run
    stops with both figures named instead of comparing against a wrong-sized ideal."""
    from types import SimpleNamespace

    p = plan.NodePlan()
    ideal = plan.ideal_run(p, 512, 2048)

    def b_with(borrowed, lent):
        peaks = {("busy", "swiftcache_borrowed_tokens"): borrowed,
                 ("donor", "swiftcache_lent_tokens"): lent}
        return SimpleNamespace(sampler=SimpleNamespace(peak=lambda r, n: peaks[(r, n)]),
                               busy=SimpleNamespace(log_path="busy.log"),
                               donor=SimpleNamespace(log_path="donor.log"))

    runner.check_ideal(ideal, p, b_with(512.0, 2048.0))
    with pytest.raises(RuntimeError, match="moved 508 busy tokens borrowed / 2048 donor"):
        runner.check_ideal(ideal, p, b_with(508.0, 2048.0))
    with pytest.raises(RuntimeError, match="moved 0 busy"):
        runner.check_ideal(ideal, p, b_with(None, None))


def test_noise_floor_is_the_twins_burst_p99_over_stock():
    """donor_ttft_p99_noise = the twin's burst TTFT P99 / (a)'s; the per-donor burst P99s and
    means beside it, with the mean's (b) / (a) and (t) / (a); the twin's ratios None without a
    twin."""
    from types import SimpleNamespace

    def recs(ms):
        return [RequestRecord(session=f"burst-{i}", turn=1, server="burst", t_send=0.0,
                              ttft=v / 1e3) for i, v in enumerate(ms)]

    tables = {k: report.run_tables({"burst": recs(ms)})
              for k, ms in (("a", [400.0] * 6), ("b", [440.0] * 6))}
    twin = SimpleNamespace(records={"burst": recs([500.0] * 6)})
    out = report.noise_floor(tables, twin)
    assert out == {"donor_burst_p99_ms": {"a": 400.0, "b": 440.0, "t": 500.0},
                   "donor_ttft_p99_noise": 1.25,
                   "donor_burst_mean_ms": {"a": 400.0, "b": 440.0, "t": 500.0},
                   "donor_burst_mean_ratio": 1.1, "donor_burst_mean_noise": 1.25}
    alone = report.noise_floor(tables, None)
    assert alone["donor_ttft_p99_noise"] is None and alone["donor_burst_mean_noise"] is None
    # one slow burst moves the P99 (about the slowest burst) more than the mean
    tables["b"] = report.run_tables({"burst": recs([400.0] * 5 + [640.0])})
    out = report.noise_floor(tables, twin)
    assert out["donor_burst_p99_ms"]["b"] > 600 and out["donor_burst_mean_ratio"] == 1.1


def test_start_servers_warms_every_donor_before_the_swiftcache_busy_server_starts(monkeypatch):
    """All donors and the stock busy servers start side by side, each donor is warmed, then the
    SwiftCache busy server starts, then each run waits for its lease: no borrower exists before
    every donor ran its warm-up."""
    from types import SimpleNamespace

    log: list = []

    def fake(key):
        def register(stack):
            log.append(("register", key))

        node = SimpleNamespace(spec=SimpleNamespace(key=key, swiftcache=key == "b"),
                               register=register,
                               donor=SimpleNamespace(base_url=f"d{key}", name=f"d{key}"),
                               busy=SimpleNamespace(name=f"b{key}"), traffic=None,
                               lease_wait_s=0.0)
        node.await_lease = lambda: log.append(("lease", key))
        return node

    monkeypatch.setattr(runner, "start_all",
                        lambda servers: log.append(("start", [s.name for s in servers])))
    monkeypatch.setattr(runner, "warm_up_donor", lambda url, traffic: log.append(("warm", url)))
    nodes = [fake(k) for k in "abc"]
    twin = fake("t")
    twin.busy = None
    with contextlib.ExitStack() as stack:
        runner.start_servers(nodes, twin, stack, lambda line: None)
    assert log == [("register", "a"), ("register", "b"), ("register", "c"), ("register", "t"),
                   ("start", ["da", "db", "dc", "dt", "ba", "bc"]),
                   ("warm", "da"), ("warm", "db"), ("warm", "dc"), ("warm", "dt"),
                   ("start", ["bb"]),
                   ("lease", "a"), ("lease", "b"), ("lease", "c")]
