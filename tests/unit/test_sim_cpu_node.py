"""The CPU-node validation model (simulator/cpu_calibration.py, cpu_node.py, validate.py): fits
recover the costs they were given, and the simulated node caches and times requests the way
SGLang's servers on this node do."""

import copy

import pytest

from benchmarks.simulator import cpu_calibration as cc
from benchmarks.simulator import validate as val
from benchmarks.simulator.cpu_node import simulate_node, steady_order

PREFILL = {"a_s": 0.05, "b_s_per_token": 0.001, "c_s_per_token_ctx": 2e-6}
DECODE = {"d0_s": 0.01, "d1_s_per_token": 1e-5}


def test_fits_recover_the_costs_that_made_the_points():
    """Least squares on exact points gives back the prefill and decode coefficients."""
    pts = [{"new": n, "cached": c,
            "ttft_s": (PREFILL["a_s"] + PREFILL["b_s_per_token"] * n
                       + PREFILL["c_s_per_token_ctx"] * n * (c + n / 2))}
           for n, c in ((20, 0), (100, 0), (400, 0), (60, 300), (60, 500))]
    assert cc.fit_prefill(pts) == pytest.approx(PREFILL, rel=1e-6)
    dec = [{"context": x, "step_s": DECODE["d0_s"] + DECODE["d1_s_per_token"] * x}
           for x in (50, 400)]
    assert cc.fit_decode(dec) == pytest.approx(DECODE, rel=1e-6)


def test_a_fit_never_turns_a_cost_into_a_rebate():
    """Noise that would make a coefficient negative drops that term instead."""
    pts = [{"new": 100, "cached": 0, "ttft_s": 0.2}, {"new": 200, "cached": 0, "ttft_s": 0.1},
           {"new": 300, "cached": 0, "ttft_s": 0.05}]
    fit = cc.fit_prefill(pts)
    assert all(v >= 0 for v in fit.values())


def _conversation(sid: str, base: int, turns: int, user: int, out: int) -> list[dict]:
    """Token ids of a chat whose turn k+1 prompt is turn k's prompt + answer + a new message."""
    items, prompt, nxt = [], [], base
    for t in range(turns):
        prompt = prompt + list(range(nxt, nxt + user))
        nxt += user
        answer = list(range(nxt, nxt + out))
        nxt += out
        items.append({"session": sid, "turn": t + 1, "prompt_ids": list(prompt),
                      "output_ids": answer})
        prompt = prompt + answer
    return items


def _calibration(busy_pool_fits_one: bool = True) -> tuple[dict, dict]:
    plan = {"busy_pool": 160, "donor_pool": 4096, "lend_fraction": 0.5, "reclaim_watermark": 0.8,
            "conversations": 2, "turns": 3, "max_tokens": 8, "max_chars": 600,
            "donor_conversations": 1, "donor_requests": 2, "donor_interval_s": 1.0,
            "donor_max_tokens": 4}
    model = {"prefill_fit": PREFILL, "decode_fit": DECODE}
    cal = {"schema": cc.SCHEMA, "date": "test", "plan": plan, "loadavg_1min": [0, 0],
           "models": {"busy": {"name": "busy", "layers": 8, "kv_bytes_per_token": 8192, **model},
                      "donor": {"name": "donor", "layers": 4, "kv_bytes_per_token": 2048, **model}},
           "copy": {"load": {"latency_s": 0.001, "bytes_per_s": 1e9},
                    "store": {"latency_s": 0.001, "bytes_per_s": 1e9}},
           "trace": {"busy": (_conversation("x", 1000, 3, 40, 8)
                              + _conversation("y", 5000, 3, 40, 8)),
                     "donor": _conversation("d", 9000, 2, 10, 4), "burst": []}}
    return cal, plan


def test_stock_misses_what_its_pool_cannot_hold_and_the_ideal_and_donor_tier_keep_it():
    """Two conversations interleaved, a busy pool that holds about one history: stock loses each
    history before its next turn (only what it still holds is cached); the ideal pool (grown by
    the loan) and SwiftCache's donor tier keep the histories, so both cache more."""
    cal, plan = _calibration()
    runs = simulate_node(cal, plan)
    cached = {k: r["tables"]["busy"]["cached_tokens"] for k, r in runs.items()}
    # a full hit on turn k+1 is turn k's prompt + all but its last answer token
    full = sum(len(t["prompt_ids"]) + len(t["output_ids"]) - 1
               for t in cal["trace"]["busy"] if t["turn"] < 3)
    assert cached["a"] < full
    assert cached["c"] == full
    assert cached["a"] < cached["b"] <= full
    assert runs["b"]["lent_blocks"] == int(0.5 * 4096 * 2048 // 8192)
    assert runs["c"]["busy_pool"] == 160 + runs["b"]["lent_blocks"]


def test_a_cold_request_takes_the_fitted_prefill_time():
    """The first request of a run (nothing cached, nothing queued) has TTFT = a + b n +
    c n (n/2)."""
    cal, plan = _calibration()
    rec = simulate_node(cal, plan)["a"]["records"]["busy"][0]
    n = rec.prompt_tokens
    want = PREFILL["a_s"] + PREFILL["b_s_per_token"] * n + PREFILL["c_s_per_token_ctx"] * n * n / 2
    assert rec.ttft == pytest.approx(want, rel=1e-9)


def test_the_busy_order_is_turn_by_turn_and_a_missing_turn_is_named():
    """Turn 1 of every conversation, then turn 2, ...; a trace without a turn the plan needs is
    refused with the fix."""
    cal, _ = _calibration()
    order = steady_order(cal["trace"]["busy"], 3)
    assert [(t["session"], t["turn"]) for t in order] == [("x", 1), ("y", 1), ("x", 2), ("y", 2),
                                                          ("x", 3), ("y", 3)]
    with pytest.raises(ValueError, match="calibrate_cpu.py"):
        steady_order(cal["trace"]["busy"][:-1], 3)


def test_validation_refuses_a_calibration_of_another_plan():
    """A trace of another bench_node plan cannot be compared; the error names the fix."""
    cal, plan = _calibration()
    live = {"plan": dict(plan, turns=6)}
    with pytest.raises(ValueError, match="--plan"):
        val.check_same_plan(cal, live)
    val.check_same_plan(cal, {"plan": copy.deepcopy(plan)})


def test_the_trace_check_finds_a_prompt_of_another_length():
    """The traced workload is compared prompt by prompt with the live records."""
    cal, _ = _calibration()
    recs = [{"session": t["session"], "turn": t["turn"], "prompt_tokens": len(t["prompt_ids"])}
            for t in cal["trace"]["busy"]]
    assert val.trace_matches(cal, {"records": {"a": {"busy": recs}}})["mismatched"] == []
    recs[2]["prompt_tokens"] += 1
    assert len(val.trace_matches(cal, {"records": {"a": {"busy": recs}}})["mismatched"]) == 1


def _live_from(runs: dict, plan: dict, cached_scale: float, ttft_scale: float) -> dict:
    """A bench_node record file whose busy figures are the simulated ones scaled."""
    live = {"plan": plan, "tables": {}, "records": {},
            "summary": {"date": "test", "loadavg_1min": {}, "pools": {}}}
    for k, r in runs.items():
        recs = [{"session": x.session, "turn": x.turn, "prompt_tokens": x.prompt_tokens,
                 "cached_tokens": round(x.cached_tokens * cached_scale),
                 "ttft": x.ttft * ttft_scale}
                for x in r["records"]["busy"]]
        t = copy.deepcopy(r["tables"])
        t["busy"]["cached_tokens"] = round(t["busy"]["cached_tokens"] * cached_scale)
        t["busy"]["ttft_p50_ms"] *= ttft_scale
        t["busy"]["ttft_p99_ms"] *= ttft_scale
        live["tables"][k], live["records"][k] = t, {"busy": recs}
        live["summary"]["pools"][k] = {"busy": r["busy_pool"], "donor": r["donor_pool"]}
    return live


def test_validate_reports_relative_errors_per_run_and_overall(tmp_path, capsys):
    """--validate's last line holds ttft_p50_error and cached_tokens_error, |sim - live| / live,
    per run and overall: against live figures of 2x the cached tokens and 1.25x the TTFTs they are
    0.5 and 0.2 in every run."""
    import json

    from benchmarks.simulator import cli

    cal, plan = _calibration()
    live = _live_from(simulate_node(cal, plan), plan, cached_scale=2.0, ttft_scale=1.25)
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    (tmp_path / "live.json").write_text(json.dumps(live))
    assert cli.main(["--validate", "--calibration", str(tmp_path / "cal.json"), "--live",
                     str(tmp_path / "live.json"), "--out", str(tmp_path / "out")]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["cached_tokens_error"] == pytest.approx(0.5, abs=0.01)
    assert s["ttft_p50_error"] == pytest.approx(0.2, abs=1e-3)
    assert set(s["per_run"]) == {"stock", "swiftcache", "ideal"}
    for run in s["per_run"].values():
        assert run["ttft_p50_error"] == pytest.approx(0.2, abs=1e-3)
    assert s["trace_matches_live"] is True


def test_long_context_cli_prints_the_stepwise_figures(capsys, tmp_path):
    """--long-context ends with a JSON line: LWM-Text-1M's maximum context against SGLang and vLLM
    (SwiftCache's larger) and the per-token slowdown at the maximum (a decode step streamed is
    slower than resident)."""
    import json

    from benchmarks.simulator import cli

    assert cli.main(["--long-context", "--out", str(tmp_path)]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["simulated"] is True and s["model"] == "LWM-Text-1M"
    tok = s["max_context_tokens"]
    assert tok["swiftcache"] > tok["sglang"] == tok["vllm"] > 0
    assert s["max_context_ratio"] == pytest.approx(tok["swiftcache"] / tok["sglang"], abs=1e-3)
    assert s["decode_slowdown_at_max"] > 1.0
