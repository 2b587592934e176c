"""The simulated bench_tiers node (benchmarks/simulator/cpu_tiers.py, validate_tiers.py) on a
synthetic calibration: tiny pools, four conversations of three turns.

Invariants: a host tier caches more than the device alone when histories outgrow the device;
in (s) the donor's burst takes back every lent block once, what the donor tier held either moves
to host or is lost, and no donor copy is left; the upper bound (u) is one stock pool of the
device, lent and host tokens as `TierPlan.bound_pool` sizes it, with no lower tier; a live file
equal to the simulation validates with zero error and the same bound pool; a file of another
plan, with L3, from bench_node or with the older baseline run (i) is refused naming why; the
calibration's host copy figures come from SGLang's host pool (its capacity, positive costs).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from benchmarks.simulator import cpu_tiers, validate_tiers

PLAN = {"busy_pool": 48, "host_ratio": 1.0, "donor_pool": 256, "lend_fraction": 0.5,
        "conversations": 4, "turns": 3, "max_chars": 200, "max_tokens": 4,
        "burst_after_turn": 2, "burst_requests": 1, "burst_words": 10, "burst_max_tokens": 4,
        "l3": None, "write_policy": "write_back"}
FIT = {"latency_s": 1e-4, "bytes_per_s": 1e9}


def _trace() -> list[dict]:
    """Each turn's prompt is the history (earlier prompts and answers) plus 8 new tokens."""
    out = []
    for s in range(PLAN["conversations"]):
        history: list[int] = []
        for t in range(1, PLAN["turns"] + 1):
            prompt = history + [1000 * s + 10 * t + k for k in range(8)]
            answer = [1000 * s + 10 * t + 100 + k for k in range(PLAN["max_tokens"])]
            out.append({"session": f"c{s}", "turn": t, "prompt_ids": prompt,
                        "output_ids": answer})
            history = prompt + answer
    return out


def _cal() -> dict:
    cap = PLAN["busy_pool"]  # host_ratio 1
    return {"schema": 1, "bench": "tiers", "date": "2026-01-01T00:00:00+00:00",
            "plan": dict(PLAN), "loadavg_1min": [0.0, 0.0],
            "models": {"busy": {"name": "small", "layers": 2, "kv_bytes_per_token": 8192,
                                "prefill_fit": {"a_s": 0.01, "b_s_per_token": 1e-4,
                                                "c_s_per_token_ctx": 0.0},
                                "decode_fit": {"d0_s": 1e-3, "d1_s_per_token": 0.0}},
                       "donor": {"name": "tiny", "layers": 1, "kv_bytes_per_token": 2048}},
            "copy": {"load": FIT, "store": FIT},
            "host_copy": {"load": FIT, "store": FIT,
                          "capacity_tokens": {"h": cap, "s": cap}},
            "trace": {"busy": _trace()}}


def _live_from(sim: dict) -> dict:
    recs = {run: [r.to_json() for r in res["records"]] for run, res in sim.items()}
    s = sim["s"]
    return {"plan": dict(PLAN), "records": recs,
            "summary": {"hits_by_tier": dict(s["hits_by_tier"], l3=0),
                        "rescued_tokens": s["rescued_tokens"],
                        "recomputed_after_reclaim_tokens": 0,
                        "upper_bound_pool_tokens": sim["u"]["pools"]["busy"]}}


def test_a_host_tier_keeps_what_the_device_cannot():
    """Histories past the device pool: (h) caches more than stock (r)."""
    sim = cpu_tiers.simulate_tiers(_cal(), PLAN)
    r, h = sim["r"]["table"]["cached_tokens"], sim["h"]["table"]["cached_tokens"]
    assert h > r
    assert sim["h"]["hits_by_tier"]["host"] > 0 and sim["h"]["hits_by_tier"]["donor"] == 0


def test_the_burst_takes_back_every_lent_block_once_and_leaves_no_donor_copy():
    """(s): one reclaim after turn `burst_after_turn`; the donor tier's content moved to host or
    was lost; nothing is left in the donor tier and no load failed."""
    cal = _cal()
    res = cpu_tiers.simulate_run(cal, PLAN, "s")
    assert res["lent_blocks"] == 256 * 0.5 * 2048 // 8192
    assert res["reclaims"] == 1
    assert res["rescued_tokens"] + res["lost_at_reclaim_tokens"] > 0
    assert res["copied_tokens"].get("device->donor", 0) > 0
    assert res["donor_tier_tokens_end"] == 0
    assert res["load_failures"] == 0


def test_a_donor_that_lent_again_after_its_burst_holds_the_last_turns_again():
    """With `relent_after_burst` (the live donor lent again in the pause after its burst) the
    borrower takes one new lease of the same blocks: the last turn's evictions go to the donor
    tier again and it holds content at the end; the reclaim itself is the same."""
    cal = _cal()
    once = cpu_tiers.simulate_run(cal, PLAN, "s")
    again = cpu_tiers.simulate_run(cal, dict(PLAN, relent_after_burst=True), "s")
    assert again["reclaims"] == once["reclaims"] == 1
    assert again["rescued_tokens"] == once["rescued_tokens"]
    assert again["donor_tier_tokens_end"] > 0
    assert again["copied_tokens"]["device->donor"] > once["copied_tokens"]["device->donor"]


def test_the_upper_bound_is_one_stock_pool_of_device_lent_and_host_tokens():
    """(u): device 48 + lent 32 + host (SGLang's 48 x 1.0 + 1 padding token, or the measured
    capacity where larger), no host tier, the donor's pool less what it lends; its cached tokens
    all come from that one pool, at least stock's. The older run (i) is no simulated run."""
    cal = _cal()
    assert cpu_tiers.run_pools(cal, PLAN, "u") == (48 + 32 + 49, 0, PLAN["donor_pool"] - 128)
    from benchmarks.nodebench.plan import ModelFacts
    from benchmarks.tiers.plan import TierPlan

    keys = ("busy_pool", "host_ratio", "donor_pool", "lend_fraction")
    live_plan = TierPlan(**{k: PLAN[k] for k in keys})
    busy, donor = (ModelFacts(n, 2, kv, 0.0, 0) for n, kv in (("small", 8192), ("tiny", 2048)))
    for cap in (48, 60):  # the live sizing, with (s)'s measured host tier as the live run reads it
        big = copy.deepcopy(cal)
        big["host_copy"]["capacity_tokens"]["s"] = cap
        assert cpu_tiers.upper_bound_pool(big, PLAN) == live_plan.bound_pool(busy, donor, cap)
    assert cpu_tiers.run_pools(cal, PLAN, "r")[1] == 0
    with pytest.raises(ValueError, match="unknown run"):
        cpu_tiers.run_pools(cal, PLAN, "i")
    with pytest.raises(ValueError, match="storage tier"):
        cpu_tiers.upper_bound_pool(cal, dict(PLAN, l3="file"))
    sim = cpu_tiers.simulate_tiers(cal, PLAN)
    u = sim["u"]
    assert u["hits_by_tier"]["host"] == u["hits_by_tier"]["donor"] == 0
    assert u["lent_blocks"] == 0 and u["reclaims"] == 0
    assert u["table"]["cached_tokens"] >= sim["r"]["table"]["cached_tokens"] > 0


def test_a_live_file_equal_to_the_simulation_validates_with_zero_error(tmp_path):
    cal = _cal()
    sim = cpu_tiers.simulate_tiers(cal, PLAN)
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    (tmp_path / "records.json").write_text(json.dumps(_live_from(sim)))
    res = validate_tiers.validate(tmp_path / "cal.json", tmp_path / "records.json")
    assert all(f["error"] == 0 for f in res["validation"].values())
    assert res["all_within_20pct"] and all(res["within_20pct"].values())
    assert all(c["equal"] for c in res["consistency_check"].values())
    assert "upper bound cached tokens" in res["consistency_check"]
    assert "upper bound TTFT P99 (ms)" in res["validation"]
    assert not res["trace"]["mismatched"]
    assert res["upper_bound_pool_tokens"] == {"live": 129, "sim": 129, "equal": True}
    assert "hicache+swiftcache" in validate_tiers.format_tables(res)
    assert "DIFFERENT" not in validate_tiers.format_tables(res)
    line = validate_tiers.summary_line(res)
    assert line["bench"] == "tiers" and line["upper_bound_pool_tokens"]["equal"]


def test_a_live_bound_pool_other_than_the_simulated_one_is_reported(tmp_path):
    cal = _cal()
    live = _live_from(cpu_tiers.simulate_tiers(cal, PLAN))
    live["summary"]["upper_bound_pool_tokens"] = 140
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    (tmp_path / "records.json").write_text(json.dumps(live))
    res = validate_tiers.validate(tmp_path / "cal.json", tmp_path / "records.json")
    assert res["upper_bound_pool_tokens"] == {"live": 140, "sim": 129, "equal": False}
    assert "live 140 | simulated 129 DIFFERENT" in validate_tiers.format_tables(res)
    del live["summary"]["upper_bound_pool_tokens"]  # a summary that does not say: not a mismatch
    (tmp_path / "records.json").write_text(json.dumps(live))
    res = validate_tiers.validate(tmp_path / "cal.json", tmp_path / "records.json")
    assert res["upper_bound_pool_tokens"]["equal"] is None
    assert "DIFFERENT" not in validate_tiers.format_tables(res)


def test_a_live_file_with_the_older_baseline_run_is_refused_naming_it(tmp_path):
    """A bench_tiers record of the older baseline (i) and no (u): the simulator models only
    the upper bound, so it says so instead of failing on a missing run."""
    live = _live_from(cpu_tiers.simulate_tiers(_cal(), PLAN))
    live["records"]["i"] = live["records"].pop("u")
    path = tmp_path / "records.json"
    path.write_text(json.dumps(live))
    with pytest.raises(ValueError, match="older baseline run \\(i\\)"):
        validate_tiers.load_live(path)


def test_files_of_another_plan_with_l3_or_from_bench_node_are_refused(tmp_path):
    cal = _cal()
    live = _live_from(cpu_tiers.simulate_tiers(cal, PLAN))
    other = copy.deepcopy(live)
    other["plan"]["turns"] = 4
    with pytest.raises(ValueError, match="another plan"):
        validate_tiers.check_same_plan(cal, other)
    for change, why in (({"l3": "file"}, "L3"), ({"host_ratio": None}, "bench_node")):
        bad = copy.deepcopy(live)
        bad["plan"].update(change)
        if change.get("host_ratio", 1) is None:
            del bad["plan"]["host_ratio"]
        path = tmp_path / f"bad-{why}.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=why):
            validate_tiers.load_live(path)
    nohost = dict(cal, host_copy=None)
    nohost.pop("host_copy")
    (tmp_path / "c.json").write_text(json.dumps(nohost))
    with pytest.raises(ValueError, match="--bench tiers"):
        validate_tiers.load_calibration(tmp_path / "c.json")


def test_the_calibrations_host_copies_go_through_sglangs_host_pool():
    """calibrate_cpu.host_copy: HostKV's capacity for each pool, positive costs."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import calibrate_cpu

    from benchmarks.nodebench.plan import ModelFacts

    facts = ModelFacts("m", 2, 2 * 2 * 2 * 8 * 4, 0.0, 0)
    cfg = {"hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2,
           "head_dim": 8}
    out = calibrate_cpu.host_copy(facts, cfg, {"h": (64, 2.0), "s": (96, 1.0)})
    assert out["capacity_tokens"]["h"] >= 128 and out["capacity_tokens"]["s"] >= 96
    for kind in ("load", "store"):
        assert out[kind]["latency_s"] >= 0 and out[kind]["bytes_per_s"] > 0
    assert [p["tokens"] for p in out["points"]] == [16, 64, 256]
