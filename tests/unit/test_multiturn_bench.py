"""scripts/bench_multiturn.py's pure parts, without servers: the traffic of SGLang's
bench_multiturn.py (prompts, ready queue, in-flight cap, histories) and the phase statistics."""

import asyncio
import random

import numpy as np
import pytest

from benchmarks.nodebench import multiturn_cli, phases
from benchmarks.nodebench.multiturn import (
    Prompts,
    ReadyQueue,
    Turn,
    Workload,
    drive,
    gap_s,
    payload,
)


def _decode(ids):
    return " ".join(str(i) for i in ids) + "|"


def test_prompts_are_consecutive_ids_from_seeded_offsets_in_the_originals_order():
    """Openings first (one per client), then clients x (rounds - 1) sub-questions, from one
    numpy generator seeded with the seed; each prompt request_length - special ids long."""
    load = Workload(clients=3, rounds=4, request_length=6, seed=7)
    p = Prompts.build(load, vocab=100, special=1, decode=_decode)
    rng = np.random.RandomState(7)
    first, rest = rng.randint(0, 100, size=3), rng.randint(0, 100, size=9)
    assert len(p.openings) == 3 and len(p.sub_questions) == 9
    assert p.openings[1] == _decode([(first[1] + 1 + j) % 100 for j in range(5)])
    assert p.sub_questions[8] == _decode([(rest[8] + 8 + j) % 100 for j in range(5)])


def test_one_round_still_draws_one_sub_question_per_client():
    p = Prompts.build(Workload(clients=2, rounds=1), vocab=50, special=0, decode=_decode)
    assert len(p.sub_questions) == 2


def test_ready_queue_pops_by_policy():
    rng = random.Random(3)
    q = ReadyQueue([0, 1, 2, 3], "random", rng)
    want = random.Random(3)
    items = [0, 1, 2, 3]
    assert [q.pop() for _ in range(4)] == [items.pop(want.randrange(len(items)))
                                           for _ in range(4)]
    assert q.pop() is None
    fifo = ReadyQueue([5, 6], "fifo", rng)
    fifo.append(7)
    assert [fifo.pop(), fifo.pop(), fifo.pop()] == [5, 6, 7]


def test_gaps_follow_the_distribution():
    rng = random.Random(0)
    load = Workload(request_rate=4.0)
    gaps = [gap_s(load, rng) for _ in range(4000)]
    assert 0.23 < sum(gaps) / len(gaps) < 0.27
    uni = [gap_s(Workload(request_rate=4.0, distribution="uniform"), rng) for _ in range(100)]
    assert all(0 <= g <= 0.5 for g in uni)


def test_payload_is_the_originals():
    body = payload("hi", 64)
    assert body["text"] == "hi" and body["stream"] is True
    assert body["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 64,
                                       "ignore_eos": True}


def _fake_server(answer_s: float, seen: list, in_flight: list):
    """A `send` that answers after `answer_s` with text naming the request."""
    state = {"now": 0, "max": 0}

    async def send(url, body, turn: Turn):
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        seen.append((turn.client, turn.round, body["text"]))
        await asyncio.sleep(answer_s)
        turn.ttft, turn.text = answer_s / 2, f"<a{turn.client}.{turn.round}>"
        state["now"] -= 1
        in_flight[:] = [state["max"]]

    return send


def test_drive_caps_in_flight_and_builds_each_history_from_answers_and_popped_questions():
    load = Workload(clients=4, rounds=3, max_parallel=2, request_rate=500.0, seed=1)
    prompts = Prompts(openings=[f"O{c}" for c in range(4)],
                      sub_questions=[f"Q{i}" for i in range(8)])
    seen, peak = [], [0]
    turns = asyncio.run(drive("http://x", load, prompts, send=_fake_server(0.01, seen, peak)))
    assert len(turns) == 12 and peak == [2]
    assert sorted((t.client, t.round) for t in turns) == [(c, r) for c in range(4)
                                                          for r in range(3)]
    texts = {(c, r): text for c, r, text in seen}
    used = []
    for c in range(4):
        h = texts[(c, 2)]
        assert h.startswith(f"O{c}<a{c}.0>Q") and f"<a{c}.1>Q" in h
        used += [h.split(f"<a{c}.0>")[1].split("<")[0], h.split(f"<a{c}.1>")[1]]
    assert sorted(used) == sorted(f"Q{i}" for i in range(8))  # each sub-question once


def test_drive_order_is_the_seeds():
    """The same seed and the same answer times give the same order of clients."""
    load = Workload(clients=5, rounds=2, max_parallel=1, request_rate=1000.0, seed=4)
    prompts = Prompts([f"O{c}" for c in range(5)], [f"Q{i}" for i in range(5)])
    orders = []
    for _ in range(2):
        seen = []
        asyncio.run(drive("u", load, prompts, send=_fake_server(0.002, seen, [0])))
        orders.append([(c, r) for c, r, _ in seen])
    assert orders[0] == orders[1]
    assert [c for c, r, in orders[0] if r == 0] != list(range(5)) or load.seed != 4


def test_drive_stops_on_a_failed_request():
    async def fail(url, body, turn):
        turn.error = "HTTP 500"

    with pytest.raises(RuntimeError, match="HTTP 500"):
        asyncio.run(drive("u", Workload(clients=2, rounds=1, request_rate=1000.0),
                          Prompts(["a", "b"], ["c", "d"]), send=fail))


def _turn(t_send=100.0, ttft=0.5, rid="r1"):
    meta = {"request_received_ts": 100.01, "queue_time": 0.2, "forward_entry_time": 100.25,
            "prefill_finished_time": 100.45}
    return {"t_send": t_send, "ttft": ttft, "rid": rid, "meta": meta}


def test_phases_add_up_to_the_ttft_and_loads_overlap():
    forwards = [{"start": 99.0, "end": 99.5}, {"start": 100.27, "end": 100.43}]
    loads = phases.load_index([{"t0": 100.26, "loads": [{"rid": "r1", "kind": "exchange",
                                                          "tokens": 64}],
                                "ready_ms": [10.0, 30.0], "reached_ms": [12.0, 20.0]}])
    t = phases.timeline(_turn(), forwards, loads)
    assert t["forward_start"] == 100.27 and t["load_kind"] == "exchange"
    ms = phases.phases_ms(t)
    assert sum(ms[n] for n in phases.SEQUENCE) == pytest.approx(500.0)
    assert ms["queue"] == pytest.approx(200.0) and ms["forward"] == pytest.approx(160.0)
    assert ms["load"] == pytest.approx(30.0) and ms["load_stall"] == pytest.approx(10.0)


def test_without_a_forward_trace_the_prefill_is_one_phase():
    ms = phases.phases_ms(phases.timeline(_turn(), [], {}))
    assert set(ms) == set(phases.COARSE)
    assert sum(ms.values()) == pytest.approx(500.0)


def test_a_wait_is_behind_running_requests_only_while_another_runs():
    """The part of each wait for admission that overlaps other requests' running spans (their
    union, each counted once); a wait with nothing running is not behind anything, and a
    request's own running span (after its wait) never counts."""
    def tl(queued, admitted, finished):
        return {"queued": queued, "admitted": admitted, "finished": finished}

    timelines = [tl(0.0, 0.0, 2.0),  # runs 0-2 s
                 tl(0.5, 2.0, 3.0),  # waits 0.5-2: all of it behind the first
                 tl(1.0, 2.5, 2.9),  # waits 1-2.5: behind the first, then the second
                 tl(3.5, 4.0, 5.0),  # waits 3.5-4 with nothing running
                 {"queued": 1.0}]  # never admitted: no wait known
    got = phases.queue_behind_running(timelines)
    assert got == pytest.approx([0.0, 1500.0, 1500.0, 0.0])
    assert phases.timeline({**_turn(), "latency": 2.0}, [], {})["finished"] == 102.0
    assert "finished" not in phases.timeline(_turn(), [], {})


def test_phase_stats_tail_and_the_phase_that_separates_two_runs():
    def tl(queue_ms, prefill_ms):
        base = 10.0
        return {"sent": base, "received": base, "queued": base,
                "admitted": base + queue_ms / 1e3,
                "prefilled": base + (queue_ms + prefill_ms) / 1e3,
                "first_token": base + (queue_ms + prefill_ms) / 1e3}

    a = [tl(10, 100) for _ in range(9)] + [tl(900, 100)]
    b = [tl(10, 100) for _ in range(9)] + [tl(10, 300)]
    sa, sb = phases.phase_stats(a), phases.phase_stats(b)
    assert sa["queue"]["p50"] == pytest.approx(10.0)
    assert phases.slowest_phase(sa)["phase"] == "queue"
    assert phases.slowest_phase(sb)["phase"] == "prefill"
    excess = phases.largest_excess(sa, sb)
    assert excess["phase"] == "queue" and excess["excess_ms"] > 0
    tail = phases.tail_breakdown(a, [110.0] * 9 + [1000.0], q=90)
    assert tail["requests"] == 1 and tail["mean_ms"]["queue"] == pytest.approx(900.0)


def _run(ttfts, queue_ms=10.0):
    turns = []
    for i, ttft in enumerate(ttfts):
        t = {"sent": 0.0, "received": 0.0, "queued": 0.0, "admitted": queue_ms / 1e3,
             "prefilled": ttft, "first_token": ttft}
        turns.append({"client": i, "round": 0, "ttft": ttft, "cached_tokens": 1,
                      "prompt_tokens": 2, "timeline": t})
    return {"turns": turns, "loadavg": [1] * 6, "wall_s": 1.0, "stats": {}, "work": None}


def test_point_ratios_mean_exactly_what_their_names_say():
    runs = {"stock": _run([1.0, 2.0]), "swiftcache": _run([1.0, 2.5], queue_ms=900.0),
            "ideal": _run([0.5, 1.0]), "ideal_twin": _run([0.5, 2.0])}
    p = multiturn_cli.point(runs)
    p99 = {k: np.percentile([t["ttft"] for t in r["turns"]], 99) for k, r in runs.items()}
    assert p["ttft_p99_vs_stock"] == pytest.approx(p99["swiftcache"] / p99["stock"])
    assert p["ttft_avg_vs_ideal"] == pytest.approx(1.75 / 0.75)
    assert p["twin_ttft_p99_vs_ideal"] == pytest.approx(p99["ideal_twin"] / p99["ideal"])
    assert p["phase_p99_excess_vs_stock"]["phase"] == "queue"
    seeds = multiturn_cli.over_seeds([p, {**p, "ttft_avg_vs_ideal": 1.0}])
    assert seeds["ttft_avg_vs_ideal"]["mean"] == pytest.approx((1.75 / 0.75 + 1.0) / 2)
    assert seeds["ttft_avg_vs_ideal"]["worst"] == pytest.approx(1.75 / 0.75)
    assert seeds["ttft_avg_vs_ideal"]["spread"] == pytest.approx(1.75 / 0.75 - 1.0)
    assert seeds["ttft_avg_vs_ideal"]["per_seed"] == pytest.approx([1.75 / 0.75, 1.0])


def test_stream_mode_gets_its_own_prefixed_ratios():
    runs = {"stock": _run([1.0, 2.0]), "swiftcache": _run([1.0, 2.5]),
            "swiftcache_stream": _run([0.5, 1.5]), "ideal": _run([0.5, 1.0]),
            "ideal_twin": _run([0.5, 2.0])}
    p = multiturn_cli.point(runs)
    assert p["stream_ttft_avg_vs_ideal"] == pytest.approx(1.0 / 0.75)
    assert p["ttft_avg_vs_ideal"] == pytest.approx(1.75 / 0.75)
    only_stream = multiturn_cli.point({k: v for k, v in runs.items() if k != "swiftcache"})
    assert "ttft_avg_vs_ideal" not in only_stream and "stream_ttft_avg_vs_ideal" in only_stream
    seeds = multiturn_cli.over_seeds([only_stream, only_stream])
    assert seeds["stream_ttft_avg_vs_ideal"]["spread"] == 0.0 and "ttft_avg_vs_ideal" not in seeds


def test_the_gap_to_the_ideal_splits_into_uncached_tokens_queue_and_the_rest():
    def turn(ttft, uncached, queue_s=0.0, prompt=500):
        return {"ttft": ttft, "prompt_tokens": prompt, "cached_tokens": prompt - uncached,
                "timeline": {"queued": 10.0, "admitted": 10.0 + queue_s}}

    # the ideal: 20 ms + 1 ms per uncached token, no wait
    ideal = [turn(0.020 + u / 1000, u) for u in (100, 200, 300)]
    # a mode that misses 100 more tokens a request, waits 50 ms and runs 5 ms slower
    mine = [turn(0.020 + (u + 100) / 1000 + 0.050 + 0.005, u + 100, queue_s=0.050)
            for u in (100, 200, 300)]
    split = multiturn_cli.gap_split(mine, ideal)
    assert split["ms_per_uncached_token"] == pytest.approx(1.0)
    assert split["gap_ms"] == pytest.approx(155.0)
    assert split["uncached_ms"] == pytest.approx(100.0)
    assert split["queue_ms"] == pytest.approx(50.0)
    assert split["other_ms"] == pytest.approx(5.0)
    assert multiturn_cli.gap_split(ideal, ideal) == pytest.approx(
        {"gap_ms": 0.0, "uncached_ms": 0.0, "queue_ms": 0.0, "other_ms": 0.0,
         "ms_per_uncached_token": 1.0, "queue_behind_running_ms": 0.0})
    # request i waits 50 ms from 10 + i s, then runs 1.5 s: the first waits with nothing
    # running, the other two behind the request before them
    for i, t in enumerate(mine):
        t["timeline"].update(queued=10.0 + i, admitted=10.05 + i, finished=11.55 + i)
    for t in ideal:
        t["timeline"]["finished"] = 10.5
    running = multiturn_cli.gap_split(mine, ideal)
    assert running["queue_behind_running_ms"] == pytest.approx(100.0 / 3)
    assert running["queue_ms"] == pytest.approx(50.0)
    runs = {"stock": _run([1.0, 2.0]), "swiftcache": _run([1.0, 2.5], queue_ms=900.0),
            "ideal": _run([0.5, 1.0]), "ideal_twin": _run([0.5, 2.0])}
    p = multiturn_cli.point(runs)
    assert p["ttft_gap_split"]["queue_ms"] == pytest.approx(890.0)
    seeds = multiturn_cli.over_seeds([p, {**p, "ttft_gap_split": {**p["ttft_gap_split"],
                                                                   "queue_ms": 0.0}}])
    assert seeds["ttft_gap_split"]["queue_ms"] == pytest.approx(445.0)


def test_stream_pool_fits_the_stock_pools_local_memory():
    from benchmarks.nodebench.plan import ModelFacts, NodePlan

    small = ModelFacts("small", layers=8, kv_bytes_per_token=8 * 2 * 512,
                       matmul_flops_per_token=1, attn_flops_per_context_token=1)
    tiny = ModelFacts("tiny", layers=4, kv_bytes_per_token=2048, matmul_flops_per_token=1,
                      attn_flops_per_context_token=1)
    plan = NodePlan(busy_pool=1024, donor_pool=16384)
    sp = multiturn_cli.stream_plan(plan, small, tiny, 0.5)
    local_rows = 8 * sp.resident + multiturn_cli.STREAM_DEPTH * sp.streamed
    assert local_rows <= 8 * (1024 + 1) and sp.tokens > 2 * 1024  # more context, same memory
    lent_tiny_tokens = int(sp.donor_pool * plan.lend_fraction)
    assert lent_tiny_tokens * 2048 >= sp.streamed * 8 * 1024  # the donor lends every page
    with pytest.raises(SystemExit):
        multiturn_cli.parse(["--modes", "hicache"])
    assert multiturn_cli.parse(["--modes", "swiftcache_stream"]).systems == (
        "stock", "swiftcache_stream", "ideal", "ideal_twin")


def test_mapped_pool_is_the_stock_pools_local_memory_plus_the_loan():
    """Invariant: the depth-0 server's local rows are at most the stock pool's, its mapped rows
    at most the loan, together the ideal's pool less its padding row; its resident fraction
    gives the pool those local rows; its donor lends every piece's chunk with slack."""
    from benchmarks.nodebench.plan import ModelFacts, NodePlan
    from sglang_swift.layer_stream.mapped import mapped_rows, piece_bytes_for

    small = ModelFacts("small", layers=8, kv_bytes_per_token=8 * 2 * 512,
                       matmul_flops_per_token=1, attn_flops_per_context_token=1)
    tiny = ModelFacts("tiny", layers=4, kv_bytes_per_token=2048, matmul_flops_per_token=1,
                      attn_flops_per_context_token=1)
    plan = NodePlan(busy_pool=1024, donor_pool=16384)
    mp = multiturn_cli.mapped_plan(plan, small, tiny, 2048)
    assert (mp.local, mp.mapped, mp.tokens) == (1024, 2048, 3071)
    assert mapped_rows(mp.tokens, 1, mp.fraction, 512, piece_bytes_for(512)) == (1024, 3072)
    assert int(mp.donor_pool * plan.lend_fraction) * 2048 > mp.mapped * 8 * 1024
    args = multiturn_cli.parse([])
    assert "swiftcache_mapped" in args.systems and len(args.systems) == 6


def test_quick_runs_8_and_16_clients():
    args = multiturn_cli.parse(["--quick"])
    assert args.client_counts == [8, 16] and args.seed_list == [1, 2]
    full = multiturn_cli.parse([])
    assert full.client_counts == [8, 16, 32] and full.seed_list == [1, 2, 3]


def test_the_runs_wait_for_the_servers_start_up_load_to_pass():
    """The load falls as a 1-minute average does; the wait ends below the limit, or at the
    longest wait if it never gets there."""
    loads, now, slept = iter([9.9, 6.0, 3.1, 1.2, 1.2]), [0.0], []

    def sleep(s):
        slept.append(s)
        now[0] += s

    got = multiturn_cli.wait_until_quiet(1.5, 60.0, loadavg=lambda: (next(loads), 0, 0),
                                         sleep=sleep, clock=lambda: now[0])
    assert got == 1.2 and len(slept) == 3
    stuck = multiturn_cli.wait_until_quiet(1.5, 10.0, loadavg=lambda: (5.0, 0, 0),
                                           sleep=sleep, clock=lambda: now[0])
    assert stuck == 5.0 and now[0] <= 6.0 + 10.0 + 2.0
