"""The simulator against a live bench_tiers run (`simulate.py --validate --tiers`): its runs
simulated with `scripts/calibrate_cpu.py --bench tiers`'s parameters (cpu_tiers.py), beside
bench_tiers' saved records (`scripts/bench_tiers.py --out DIR` writes DIR/records.json).

Errors are relative, |simulated - live| / live, over the busy model's requests. The validation
is only what the simulator does not share with the live code (validation_figures.py): HiCache's
cached tokens, the TTFT P50 and P99 of every run (stock, hicache, hicache+swiftcache, upper
bound) and SwiftCache's hits by tier, each with its error; `within_20pct` holds per figure, P99
included, and `all_within_20pct` for all of them. The cached tokens of stock, SwiftCache and the
upper bound come from the same radix_ext code replaying the same trace: they are reported apart,
as a consistency check. The upper bound (u) is one stock device pool of the busy device, lent
and host tokens (cpu_tiers.upper_bound_pool); `upper_bound_pool_tokens` sets the simulated pool
beside the one the live run used (from the calibration's host capacity, not from the live
file). Nothing is tuned toward the live figures: the simulator reads only the
calibration JSON; the live file gives the plan (which sizes and traffic) and the numbers to
compare with.

The workload check (`trace`): the calibration traces bench_tiers' own prompts (run (r) replayed
through bench_tiers' turn loop), and each simulated run applies SGLang's length rules to its
pool, so every busy request of every run should be alike live and simulated: refused in both
(a prompt longer than the pool allows) or served in both with the same prompt and answer
tokens. `trace_matches_live` says so; `refused_requests` counts the refusals per run.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from . import cpu_calibration, validation_figures
from .cpu_tiers import NAMES, RUNS, simulate_tiers

PLAN_KEYS = ("busy_pool", "host_ratio", "donor_pool", "lend_fraction", "conversations", "turns",
             "max_chars", "max_tokens", "burst_after_turn")
DEFAULTS = {"write_policy": "write_back", "l3": None}  # plan keys older record files lack


def load_live(path: Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no bench_tiers records; run `.venv/bin/python "
                                f"scripts/bench_tiers.py --quick --out {path.parent}` "
                                f"(about 6 min)")
    live = json.loads(path.read_text())
    for key in ("plan", "summary", "records"):
        if key not in live:
            raise ValueError(f"{path}: not a bench_tiers record file (no {key!r})")
    if "host_ratio" not in live["plan"]:
        raise ValueError(f"{path}: not a bench_tiers record file (its plan has no host_ratio; "
                         f"a bench_node file goes to `--validate` without --tiers)")
    runs = live["records"]
    if "i" in runs and "u" not in runs:
        raise ValueError(f"{path}: made with bench_tiers' older baseline run (i), HiCache with "
                         f"the lent tokens added to its device pool, which the simulator no "
                         f"longer models; rerun `.venv/bin/python scripts/bench_tiers.py "
                         f"--quick --out {path.parent}` for a record with the upper bound (u)")
    if live["plan"].get("l3"):
        raise ValueError(f"{path}: a run with L3 storage (--l3 {live['plan']['l3']}); the "
                         f"simulator has no storage tier: validate a run without --l3")
    return live


def load_calibration(path: Path) -> dict:
    cal = cpu_calibration.load(path, roles=("busy",))
    if cal.get("bench") != "tiers" or "host_copy" not in cal:
        raise ValueError(f"{path}: not a bench_tiers calibration (no host_copy); run "
                         f"`.venv/bin/python scripts/calibrate_cpu.py --bench tiers --out {path}`")
    return cal


def check_same_plan(cal: dict, live: dict) -> None:
    keys = PLAN_KEYS + tuple(DEFAULTS)
    get = [{k: p.get(k, DEFAULTS.get(k)) for k in keys} for p in (cal["plan"], live["plan"])]
    diff = {k: (get[0][k], get[1][k]) for k in keys if get[0][k] != get[1][k]}
    if diff:
        raise ValueError(f"the calibration traced another plan than the live run ({diff}, "
                         f"calibration vs live); rerun scripts/calibrate_cpu.py --bench tiers "
                         f"--plan quick|full to match")


def trace_matches(live: dict, sim: dict) -> dict:
    """Is the simulated workload the live one, request by request in every run? For each live
    busy request: whether it was served (a live refusal has no first token), and if both
    served, its prompt tokens and the tokens generated. The live file is read for this check
    only; the simulation never sees it."""
    bad, compared = [], 0
    refused = {}
    for run in RUNS:
        if run not in live["records"] or run not in sim:
            continue
        by = {(r.session, r.turn): r for r in sim[run]["records"]}
        refused[NAMES[run]] = {"live": sum(1 for r in live["records"][run] if r["ttft"] is None),
                               "sim": len(sim[run]["refused"])}
        for lr in live["records"][run]:
            compared += 1
            sr = by.get((lr["session"], lr["turn"]))
            where = (run, lr["session"], lr["turn"])
            if sr is None:
                bad.append([*where, "missing", None, None])
                continue
            served = (lr["ttft"] is not None, sr.ttft is not None)
            if served[0] != served[1]:
                bad.append([*where, "served", *served])
                continue
            if not served[0]:
                continue
            for what, a, b in (("prompt_tokens", lr["prompt_tokens"], sr.prompt_tokens),
                               ("completion_tokens", lr["completion_tokens"],
                                sr.completion_tokens)):
                if a != b:
                    bad.append([*where, what, a, b])
    return {"compared": compared, "mismatched": bad, "refused": refused}


def _err(sim, live) -> float | None:
    if sim is None or not live:
        return None
    return round(abs(sim - live) / live, 4)


def live_table(records: list[dict], turns: int) -> dict:
    ttft = [r["ttft"] * 1e3 for r in records if r["ttft"] is not None]
    by_turn = [0] * turns
    for r in records:
        by_turn[r["turn"] - 1] += r["cached_tokens"] or 0
    from ..loadgen.stats import pct

    return {"cached_tokens": sum(r["cached_tokens"] or 0 for r in records),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "cached_by_turn": by_turn}


def per_request(sim_records, live_records: list[dict]) -> list[dict]:
    sim = {(r.session, r.turn): r for r in sim_records}
    rows = []
    for lr in live_records:
        sr = sim.get((lr["session"], lr["turn"]))
        rows.append({"session": lr["session"], "turn": lr["turn"], "prompt": lr["prompt_tokens"],
                     "cached_live": lr["cached_tokens"],
                     "cached_sim": sr.cached_tokens if sr else None,
                     "ttft_live_ms": (round(lr["ttft"] * 1e3, 1)
                                      if lr["ttft"] is not None else None),
                     "ttft_sim_ms": (round(sr.ttft * 1e3, 1)
                                     if sr and sr.ttft is not None else None)})
    return rows


def _live_hits(live: dict) -> dict | None:
    return live["summary"].get("hits_by_tier")


def validate(cal_path: Path, live_path: Path) -> dict:
    cal = load_calibration(cal_path)
    live = load_live(live_path)
    check_same_plan(cal, live)
    plan = {**DEFAULTS, **live["plan"]}
    # when the live donor lent again after its burst is the donor's timing (its cooldown, then
    # its idle time), which the simulator does not model: taken from the live run, like the
    # trace's prompts
    plan["relent_after_burst"] = bool(live["summary"].get("relent_after_burst"))
    sim = simulate_tiers(cal, plan)
    runs, errors = {}, {}
    for run in RUNS:
        if run not in live["records"]:
            continue
        lt, st = live_table(live["records"][run], plan["turns"]), sim[run]["table"]
        name = NAMES[run]
        errors[name] = {"cached_tokens_error": _err(st["cached_tokens"], lt["cached_tokens"]),
                        "ttft_p50_error": _err(st["ttft_p50_ms"], lt["ttft_p50_ms"]),
                        "ttft_p99_error": _err(st["ttft_p99_ms"], lt["ttft_p99_ms"])}
        runs[name] = {"live": lt, "sim": st, "pools_sim": sim[run]["pools"],
                      "hits_by_tier_sim": sim[run]["hits_by_tier"],
                      "copied_tokens_sim": sim[run]["copied_tokens"],
                      "requests": per_request(sim[run]["records"], live["records"][run])}
    s = sim["s"]
    swift = {"hits_by_tier": {"live": _live_hits(live), "sim": s["hits_by_tier"]},
             "rescued_tokens": {"live": live["summary"].get("rescued_tokens"),
                                "sim": s["rescued_tokens"]},
             "lost_at_reclaim_tokens_sim": s["lost_at_reclaim_tokens"],
             "recomputed_after_reclaim_tokens_live":
                 live["summary"].get("recomputed_after_reclaim_tokens"),
             "lent_blocks_sim": s["lent_blocks"]}

    figures = {name: {k: {"live": r["live"][k], "sim": r["sim"][k]}
                      for k in ("cached_tokens", "ttft_p50_ms", "ttft_p99_ms")}
               for name, r in runs.items()}
    return {"simulated_vs_live": True, "bench": "tiers", "calibration": str(cal_path),
            "live": str(live_path), "calibration_date": cal["date"],
            "live_wall_s": live["summary"].get("wall_s"),
            "loadavg_1min": {"calibration": cal["loadavg_1min"],
                             "live": {r: v[0] for r, v in live["summary"].get("loadavg",
                                                                             {}).items()}},
            "write_policy": plan["write_policy"], "trace": trace_matches(live, sim),
            "upper_bound_pool_tokens": bound_pool(live, sim),
            "trace_source": cal["trace"].get("source"),
            "trace_answers_agree": cal["trace"].get("answers_agree"),
            "runs": runs, "errors": errors, "swiftcache": swift, "figures": figures,
            **validation_figures.derive(figures, swift["hits_by_tier"])}


def bound_pool(live: dict, sim: dict) -> dict:
    """Run (u)'s one pool, live (its summary) and simulated, and whether they agree: where they
    differ the simulation ran another upper bound than the live one (None: the live summary
    does not say)."""
    lv, sv = live["summary"].get("upper_bound_pool_tokens"), sim["u"]["pools"]["busy"]
    return {"live": lv, "sim": sv, "equal": None if lv is None else lv == sv}


def _n(v, fmt="{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def format_tables(res: dict) -> str:
    load = res["loadavg_1min"]
    lines = [f"Simulated (calibration {res['calibration_date']}, load {load['calibration']}) "
             f"against live bench_tiers ({res['live']}, load {load['live']}); busy model, every "
             f"request, {res['write_policy']}",
             "", "| run | cached tokens live / sim | TTFT P50 ms live / sim "
             "| TTFT P99 ms live / sim |", "|---|---|---|---|"]
    for name, r in res["runs"].items():
        lv, sv = r["live"], r["sim"]
        lines.append(f"| {name} | {lv['cached_tokens']} / {sv['cached_tokens']} "
                     f"| {_n(lv['ttft_p50_ms'])} / {_n(sv['ttft_p50_ms'])} "
                     f"| {_n(lv['ttft_p99_ms'])} / {_n(sv['ttft_p99_ms'])} |")
    lines += ["", validation_figures.format_table(res)]
    lines += ["", "Cached tokens by turn, live | simulated:", ""]
    for name, r in res["runs"].items():
        lines.append(f"- {name}: {r['live']['cached_by_turn']} | {r['sim']['cached_by_turn']}")
    sw = res["swiftcache"]
    lines += ["", f"hicache+swiftcache hits by tier, live {sw['hits_by_tier']['live']} | "
                  f"simulated {sw['hits_by_tier']['sim']}; rescued into host at the reclaim, "
                  f"live {sw['rescued_tokens']['live']} | simulated {sw['rescued_tokens']['sim']}"
                  f"; lost at the reclaim (simulated) {sw['lost_at_reclaim_tokens_sim']}, "
                  f"recomputed after it (live) {sw['recomputed_after_reclaim_tokens_live']}"]
    ratios = {name: statistics.median(q["ttft_live_ms"] / q["ttft_sim_ms"]
                                      for q in r["requests"]
                                      if q["ttft_sim_ms"] and q["ttft_live_ms"])
              for name, r in res["runs"].items()}
    lines.append("Per request, live TTFT / simulated TTFT (median): "
                 + ", ".join(f"{n} {v:.2f}" for n, v in ratios.items()))
    same = {name: sum(1 for q in r["requests"] if q["cached_live"] == q["cached_sim"])
            for name, r in res["runs"].items()}
    lines.append("Requests with the live cached tokens exactly: "
                 + ", ".join(f"{n} {v}/{len(res['runs'][n]['requests'])}"
                             for n, v in same.items()))
    bp = res["upper_bound_pool_tokens"]
    lines.append(f"upper bound's one pool (device + lent + host tokens), live {bp['live']} | "
                 f"simulated {bp['sim']}" + (" DIFFERENT" if bp["equal"] is False else ""))
    tr = res["trace"]
    lines.append(f"simulated workload = live workload: {tr['compared'] - len(tr['mismatched'])}/"
                 f"{tr['compared']} busy requests alike (served or refused as live; served: "
                 f"prompt and answer tokens as live); refused live | simulated: "
                 + ", ".join(f"{n} {v['live']} | {v['sim']}" for n, v in tr["refused"].items()))
    for m in tr["mismatched"][:10]:
        lines.append(f"  differs: run {m[0]} {m[1]} turn {m[2]}: {m[3]} live {m[4]}, "
                     f"simulated {m[5]}")
    return "\n".join(lines)


def summary_line(res: dict) -> dict:
    return {"simulated_vs_live": True, "bench": "tiers",
            **{k: res[k] for k in ("validation", "within_20pct", "all_within_20pct",
                                   "largest_error", "consistency_check")},
            "figures": res["figures"],
            "hits_by_tier": res["swiftcache"]["hits_by_tier"],
            "rescued_tokens": res["swiftcache"]["rescued_tokens"],
            "live": res["live"], "calibration": res["calibration"],
            "calibration_date": res["calibration_date"],
            "trace_matches_live": not res["trace"]["mismatched"],
            "upper_bound_pool_tokens": res["upper_bound_pool_tokens"],
            "refused_requests": res["trace"]["refused"]}
