"""The tiers validation's workload is bench_tiers' own, checked without servers.

- `calibrate_cpu.tiers_trace` replays run (r) through bench_tiers' turn loop
  (benchmarks/tiers/runner._turns) on a fake server with a small pool that cuts answers and
  refuses long prompts, as SGLang does; every traced prompt's token ids are then those of the
  history bench_tiers' forced runs send (here run (u), a larger pool), not those of a replay of
  the model's own uncut answers;
- the simulated server applies SGLang 0.5.23's length rules (`cpu_tiers.served_tokens`, checked
  against SGLang's own code): a prompt too long for a run's pool is refused and the next request
  follows, an answer is cut to what the pool leaves; the upper bound's larger pool (one stock
  pool of device + lent + host tokens) serves both;
- `validate_tiers.trace_matches` compares every run's requests with the live ones (served or
  refused, prompt and answer tokens) and names each difference;
- the validation reports only figures the simulator does not share with the live code (HiCache's
  cached tokens, every run's TTFT P50 and P99, SwiftCache's hits by tier), P99 counting toward
  the 20% target; the cached tokens of stock, SwiftCache and the upper bound are a consistency
  check apart; the checked-in record (made with the older baseline run (i)) re-derives to the
  same split, its run labelled as that older baseline, never as the upper bound.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks.simulator import cpu_tiers, validate_tiers, validation_figures
from benchmarks.tiers import runner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import calibrate_cpu  # noqa: E402

# -- a fake SGLang: one token per word, a marker token per message, greedy answers -----------------
VOCAB: dict[str, int] = {}


def _tok(word: str) -> int:
    return VOCAB.setdefault(word, len(VOCAB) + 1)


def tokenize(messages: list[dict]) -> list[int]:
    ids = []
    for m in messages:
        ids.append(_tok(f"<{m['role']}>"))
        ids.extend(_tok(w) for w in m["content"].split())
    return ids + [_tok("<assistant>")]


def greedy(messages: list[dict], n: int) -> list[str]:
    """The model's answer: words fixed by the prompt (its length and last word)."""
    seed = len(tokenize(messages))
    last = messages[-1]["content"].split()[-1]
    return [f"{last}{seed + k}" for k in range(n)]


def fake_server(pool: int, sent: dict | None = None):
    """`runner.chat` of a stock server with a `pool`-token KV pool (SGLang's length rules)."""
    async def chat(http, url, messages, max_tokens, rec, t0):
        ids = tokenize(messages)
        if sent is not None:
            sent[(rec.session, rec.turn)] = [dict(m) for m in messages]
        n = cpu_tiers.served_tokens(len(ids), max_tokens, pool)
        if n is None:  # refused: an abort streamed back, no content
            rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = 1, 1, 0
            return rec
        rec.ttft, rec.prompt_tokens, rec.completion_tokens = 0.01, len(ids), n
        rec.cached_tokens, rec.text = 0, " ".join(greedy(messages, n))
        return rec
    return chat


async def fake_ids(http, url, messages, max_tokens):
    """`calibrate_cpu._ids` of the unlimited server: prompt ids, greedy answer ids and text."""
    words = greedy(messages, max_tokens)
    return tokenize(messages), [_tok(w) for w in words], " ".join(words)


PLAN = SimpleNamespace(turns=4, max_tokens=12)
POOL_R, POOL_U = 90, 256  # (r) cuts c2's second answer to 9 tokens, refuses three prompts


def _convs():
    user = ["alpha " * 12, "beta " * 9, "gamma " * 7, "delta " * 14]
    return [SimpleNamespace(id=f"c{c}", turns=[SimpleNamespace(user=(u * (c + 1)).strip())
                                               for u in user]) for c in range(3)]


def test_the_trace_carries_the_prompts_bench_tiers_sends(monkeypatch):
    """Run (r) on its small pool cuts answers and refuses a prompt; the trace's prompt ids are
    exactly those of the histories bench_tiers' forced runs send (here the upper bound's pool,
    which serves them all), and differ from a replay of the model's own uncut answers."""
    monkeypatch.setattr(calibrate_cpu, "_ids", fake_ids)
    convs = _convs()
    monkeypatch.setattr(runner, "chat", fake_server(POOL_R))
    trace = asyncio.run(calibrate_cpu.tiers_trace(None, "replay", "ids", convs, PLAN))
    busy = trace["busy"]
    assert [(t["session"], t["turn"]) for t in busy] == [
        (c.id, k) for k in range(1, PLAN.turns + 1) for c in convs]  # bench_tiers' order
    replayed = {(t["session"], t["turn"]): t["replay"] for t in busy}
    assert any(not r["served"] for r in replayed.values()), "the scenario must refuse a prompt"
    assert any(r["served"] and r["completion_tokens"] < PLAN.max_tokens
               for r in replayed.values()), "the scenario must cut an answer"
    assert all(t["answer_agrees"] is not False for t in busy)
    assert trace["answers_agree"] == f"{sum(r['served'] for r in replayed.values())}/" \
                                     f"{sum(r['served'] for r in replayed.values())}"

    # bench_tiers itself: run (r), then a forced run (the upper bound's pool) recording prompts
    async def bench(pool, forced, sent):
        monkeypatch.setattr(runner, "chat", fake_server(pool, sent))
        out, hist = [], [[] for _ in convs]
        await runner._turns(None, "busy", convs, hist, 0, 2, PLAN, forced, out, 0.0)
        await runner._turns(None, "busy", convs, hist, 2, PLAN.turns, PLAN, forced, out, 0.0)
        return out

    r = asyncio.run(bench(POOL_R, None, {}))
    forced = {(x.session, x.turn): x.text for x in r}
    sent_u: dict = {}
    u = asyncio.run(bench(POOL_U, forced, sent_u))
    assert all(x.ttft is not None for x in u)
    for t in busy:
        assert t["prompt_ids"] == tokenize(sent_u[(t["session"], t["turn"])])
        if not t["replay"]["served"]:  # the history goes on with the refusal's empty answer
            assert forced[(t["session"], t["turn"])] == ""
    # the replay of the model's own uncut answers (what the calibration traced before) differs
    own = {}
    for c in convs:
        msgs = []
        for k, turn in enumerate(c.turns[:PLAN.turns]):
            msgs.append({"role": "user", "content": turn.user})
            own[(c.id, k + 1)] = tokenize(msgs)
            msgs.append({"role": "assistant", "content": " ".join(greedy(msgs, PLAN.max_tokens))})
    assert any(own[(t["session"], t["turn"])] != t["prompt_ids"] for t in busy)


def test_sglangs_length_rules():
    """The quick plan's case: 374 prompt tokens on a 384-token pool generate 8; 424 are refused
    there and served whole by the upper bound's pool (384 + 512 lent + 769 host = 1665); the
    limit is max_req_len - 5 = 378."""
    assert cpu_tiers.served_tokens(374, 16, 384, 8192) == 8
    assert cpu_tiers.served_tokens(377, 16, 384, 8192) == 5
    assert cpu_tiers.served_tokens(378, 16, 384, 8192) is None
    assert cpu_tiers.served_tokens(424, 16, 384, 8192) is None
    assert cpu_tiers.served_tokens(424, 16, 1665, 8192) == 16
    assert cpu_tiers.served_tokens(100, 16, 384, 104) is None  # the context length bounds too


def test_the_length_rules_are_sglangs_own():
    """The constants of `served_tokens` read off the installed SGLang's code."""
    from sglang_swift.cpu_compat import activate_in_process

    activate_in_process()
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.managers.utils import validate_input_length
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

    src = inspect.getsource(TpModelWorker.get_worker_info)
    assert "kv_capacity - 1" in src and "max_req_input_len = max_req_len - 5" in src
    max_req_len = 383  # a 384-token pool, context 8192
    req = SimpleNamespace(origin_input_ids=[0] * 378)
    assert validate_input_length(req, max_req_len - 5, False) is not None
    req.origin_input_ids = [0] * 377
    assert validate_input_length(req, max_req_len - 5, False) is None
    alloc = SimpleNamespace(page_size=1)
    for prompt in (300, 374, 377):
        budget = BaseTokenToKVPoolAllocator.max_new_tokens_for_memory(
            alloc, prompt, min(16, max_req_len - prompt - 1), token_capacity=384,
            sliding_window_size=None, chunk_size=4096)
        assert budget == cpu_tiers.served_tokens(prompt, 16, 384, 8192)


# -- the simulated runs on a synthetic calibration -------------------------------------------------
SIM_PLAN = {"busy_pool": 48, "host_ratio": 1.0, "donor_pool": 256, "lend_fraction": 0.5,
            "conversations": 3, "turns": 3, "max_chars": 200, "max_tokens": 4,
            "burst_after_turn": 2, "burst_requests": 1, "burst_words": 10,
            "burst_max_tokens": 4, "l3": None, "write_policy": "write_back"}
FIT = {"latency_s": 1e-4, "bytes_per_s": 1e9}
NEW = {0: (8, 8, 8), 1: (8, 8, 24), 2: (8, 8, 8)}  # new prompt tokens by conversation, turn


def _trace(max_tokens: int = SIM_PLAN["max_tokens"]) -> list[dict]:
    """c1's turn 3 grows to 8 + 4 + 8 + 4 + 24 = 48 tokens: refused by a 48-token pool; every
    prompt carries the full answer before it."""
    out = []
    for s in range(SIM_PLAN["conversations"]):
        history: list[int] = []
        for t in range(1, SIM_PLAN["turns"] + 1):
            prompt = history + [1000 * s + 100 * t + k for k in range(NEW[s][t - 1])]
            answer = [1000 * s + 100 * t + 50 + k for k in range(max_tokens)]
            out.append({"session": f"c{s}", "turn": t, "prompt_ids": prompt,
                        "output_ids": answer})
            history = prompt + answer
    return sorted(out, key=lambda x: x["turn"])


def _cal() -> dict:
    cap = SIM_PLAN["busy_pool"]
    return {"schema": 1, "bench": "tiers", "date": "2026-01-01T00:00:00+00:00",
            "plan": dict(SIM_PLAN), "loadavg_1min": [0.0, 0.0],
            "models": {"busy": {"name": "small", "layers": 2, "kv_bytes_per_token": 8192,
                                "context_len": 8192,
                                "prefill_fit": {"a_s": 0.01, "b_s_per_token": 1e-4,
                                                "c_s_per_token_ctx": 0.0},
                                "decode_fit": {"d0_s": 1e-3, "d1_s_per_token": 0.0}},
                       "donor": {"name": "tiny", "layers": 1, "kv_bytes_per_token": 2048}},
            "copy": {"load": FIT, "store": FIT},
            "host_copy": {"load": FIT, "store": FIT,
                          "capacity_tokens": {"h": cap, "s": cap}},
            "trace": {"busy": _trace()}}


def _live_from(sim: dict) -> dict:
    """The simulation as bench_tiers would record it (a refusal: prompt 1, answer 1, no TTFT)."""
    recs = {}
    for run, res in sim.items():
        recs[run] = []
        for r in res["records"]:
            j = r.to_json()
            if j["ttft"] is None:
                j.update(prompt_tokens=1, completion_tokens=1, cached_tokens=0)
            recs[run].append(j)
    s = sim["s"]
    return {"plan": dict(SIM_PLAN), "records": recs,
            "summary": {"hits_by_tier": dict(s["hits_by_tier"], l3=0),
                        "rescued_tokens": s["rescued_tokens"],
                        "recomputed_after_reclaim_tokens": 0,
                        "upper_bound_pool_tokens": sim["u"]["pools"]["busy"]}}


def test_a_prompt_the_pool_refuses_is_skipped_and_the_upper_bound_serves_it():
    cal = _cal()
    sim = cpu_tiers.simulate_tiers(cal, SIM_PLAN)
    for run in ("r", "h", "s"):
        assert sim[run]["refused"] == [("c1", 3)]
        recs = {(r.session, r.turn): r for r in sim[run]["records"]}
        assert len(recs) == 9 and recs[("c1", 3)].ttft is None
        assert recs[("c1", 3)].cached_tokens == 0
        assert all(r.ttft is not None for k, r in recs.items() if k != ("c1", 3))
    assert sim["u"]["refused"] == []
    assert all(r.ttft is not None and r.completion_tokens == 4 for r in sim["u"]["records"])


def test_an_answer_is_cut_to_what_the_pool_leaves():
    """Answers of 8 tokens; c0's turn 3 (8 + 8 + 8 + 8 + 8 = 40 prompt tokens) on a 47-token
    pool: max_req_len 46, so 46 - 40 - 1 = 5 tokens are generated (and 40 < 46 - 5 is served);
    its turn 2 (24 tokens) keeps all 8."""
    cal = _cal()
    plan = dict(SIM_PLAN, busy_pool=47, max_tokens=8)
    cal["plan"], cal["trace"]["busy"] = plan, _trace(8)
    cal["host_copy"]["capacity_tokens"] = {"h": 47, "s": 47}
    res = cpu_tiers.simulate_run(cal, plan, "r")
    recs = {(r.session, r.turn): r for r in res["records"]}
    assert recs[("c0", 3)].prompt_tokens == 40 and recs[("c0", 3)].completion_tokens == 5
    assert recs[("c0", 2)].completion_tokens == 8
    assert res["refused"] == [("c1", 3)]


def test_the_trace_check_compares_every_run_request_by_request(tmp_path):
    cal = _cal()
    sim = cpu_tiers.simulate_tiers(cal, SIM_PLAN)
    live = _live_from(sim)
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    (tmp_path / "records.json").write_text(json.dumps(live))
    res = validate_tiers.validate(tmp_path / "cal.json", tmp_path / "records.json")
    assert res["trace"]["mismatched"] == [] and res["trace"]["compared"] == 4 * 9
    assert res["trace"]["refused"]["hicache"] == {"live": 1, "sim": 1}
    assert all(f["error"] == 0 for f in res["validation"].values())
    line = validate_tiers.summary_line(res)
    assert line["trace_matches_live"] and line["refused_requests"]["upper bound"]["sim"] == 0
    assert "refused live | simulated" in validate_tiers.format_tables(res)

    other = copy.deepcopy(live)
    other["records"]["h"][0]["prompt_tokens"] += 1
    other["records"]["s"][-1]["ttft"] = None
    served_u = next(r for r in other["records"]["u"] if r["session"] == "c1" and r["turn"] == 3)
    served_u["completion_tokens"] = 3
    got = validate_tiers.trace_matches(other, sim)["mismatched"]
    assert [m[0] for m in got] == ["h", "s", "u"]
    assert [m[3] for m in got] == ["prompt_tokens", "served", "completion_tokens"]


def _figures(p99_sim: float = 100.0, cached_s_sim: int = 50, bound: str = "upper bound") -> dict:
    runs = {}
    for run in ("stock", "hicache", "hicache+swiftcache", bound):
        runs[run] = {"cached_tokens": {"live": 50, "sim": 50},
                     "ttft_p50_ms": {"live": 50.0, "sim": 50.0},
                     "ttft_p99_ms": {"live": 100.0, "sim": 100.0}}
    runs["hicache+swiftcache"]["ttft_p99_ms"]["sim"] = p99_sim
    runs["hicache+swiftcache"]["cached_tokens"]["sim"] = cached_s_sim
    return runs


def test_only_independent_figures_validate_and_p99_counts_toward_the_target():
    """Invariant: a P99 off by more than 20% fails the target; SwiftCache's cached tokens (the
    same radix_ext code) never enter the validation, only the consistency check; HiCache's cached
    tokens and every run's P50 and P99 and the hits by tier do."""
    hits = {"live": {"device": 100, "donor": 50, "host": 30, "l3": 0},
            "sim": {"device": 100, "donor": 50, "host": 30}}
    ok = validation_figures.derive(_figures(), hits)
    assert ok["all_within_20pct"]
    assert set(ok["validation"]) == {
        "hicache cached tokens", *(f"{run} TTFT {p} (ms)" for run in
                                   ("stock", "hicache", "hicache+swiftcache", "upper bound")
                                   for p in ("P50", "P99")),
        *(f"hicache+swiftcache hits from {t} (tokens)" for t in ("device", "donor", "host"))}
    assert "upper bound cached tokens" in ok["consistency_check"]
    assert validation_figures.OLDER_BASELINE_NOTE not in validation_figures.format_table(ok)
    slow = validation_figures.derive(_figures(p99_sim=125.0), hits)
    assert not slow["all_within_20pct"]
    assert slow["within_20pct"] == {**ok["within_20pct"],
                                    "hicache+swiftcache TTFT P99 (ms)": False}
    assert slow["largest_error"] == {"figure": "hicache+swiftcache TTFT P99 (ms)", "error": 0.25}
    off = validation_figures.derive(_figures(cached_s_sim=10), hits)
    assert off["validation"] == ok["validation"] and off["all_within_20pct"]
    assert not off["consistency_check"]["hicache+swiftcache cached tokens"]["equal"]
    wrong_tier = validation_figures.derive(_figures(), {**hits, "sim": {**hits["sim"],
                                                                       "donor": 80}})
    assert not wrong_tier["within_20pct"]["hicache+swiftcache hits from donor (tokens)"]


def test_the_checked_in_record_re_derives_from_its_own_figures():
    """Invariant: docs/records/simulate_validate_tiers.json holds what the validation needs (per
    run live and simulated figures, hits by tier); re-derived, every figure's error is
    |sim - live| / live of those numbers and the consistency runs stay out of it."""
    path = Path(__file__).resolve().parents[2] / "docs" / "records" / "simulate_validate_tiers.json"
    result = json.loads(path.read_text())["result"]
    got = validation_figures.from_result(result)
    f = result["figures"]
    p99 = got["validation"]["hicache+swiftcache TTFT P99 (ms)"]
    live, sim = f["hicache+swiftcache"]["ttft_p99_ms"]["live"], \
        f["hicache+swiftcache"]["ttft_p99_ms"]["sim"]
    assert p99["error"] == round(abs(sim - live) / live, 4)
    assert got["within_20pct"]["hicache+swiftcache TTFT P99 (ms)"] == (p99["error"] <= 0.2)
    assert "hicache+swiftcache cached tokens" not in got["validation"]
    bound = "upper bound" if "upper bound" in f else validation_figures.OLDER_BASELINE
    label = validation_figures.LABELS.get(bound, bound)
    assert set(got["consistency_check"]) == {"stock cached tokens",
                                             "hicache+swiftcache cached tokens",
                                             f"{label} cached tokens"}
    older = bound == validation_figures.OLDER_BASELINE
    names = [*got["validation"], *got["consistency_check"]]
    assert older != any("upper bound" in n for n in names), "older records never say upper bound"
    assert (validation_figures.OLDER_BASELINE_NOTE in validation_figures.format_table(got)) == older
    assert len(got["within_20pct"]) == 1 + 2 * 4 + len(
        [t for t in set(result["hits_by_tier"]["live"]) | set(result["hits_by_tier"]["sim"])
         if result["hits_by_tier"]["live"].get(t, 0) or result["hits_by_tier"]["sim"].get(t, 0)])


def test_an_older_records_ideal_is_labelled_the_older_baseline_never_the_upper_bound():
    """Invariant: figures of the older run (i) keep their name with "(older baseline)" and the
    table says what it was (HiCache with the lent tokens in its device pool, not an upper
    bound); the same numbers under the upper bound's name give the upper bound's labels."""
    hits = {"live": {"device": 100}, "sim": {"device": 100}}
    old = validation_figures.derive(_figures(bound="ideal"), hits)
    assert "ideal (older baseline) TTFT P99 (ms)" in old["validation"]
    assert "ideal (older baseline) cached tokens" in old["consistency_check"]
    table = validation_figures.format_table(old)
    assert "not an upper bound" in table and "upper bound cached" not in table
    new = validation_figures.derive(_figures(), hits)
    assert [r["error"] for r in old["validation"].values()] == \
        [r["error"] for r in new["validation"].values()]
