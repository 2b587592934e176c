"""The simulator against the live CPU node (`simulate.py --validate`): bench_node's steady phase
simulated with scripts/calibrate_cpu.py's parameters, beside bench_node's saved records.

Errors are relative, |simulated - live| / live, per run (stock, swiftcache, ideal) on the busy
model's steady phase: TTFT P50 and P99 over its requests, and its cached tokens; `overall` is
their mean over the three runs. Nothing is tuned toward the live figures: the simulator reads
only the calibration JSON, and the live JSON only for its plan (which traffic to replay) and
for the comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import cpu_calibration
from .cpu_node import simulate_node

RUN_NAMES = {"a": "stock", "b": "swiftcache", "c": "ideal"}
PLAN_KEYS = ("busy_pool", "donor_pool", "lend_fraction", "reclaim_watermark", "conversations",
             "turns", "max_tokens", "max_chars", "donor_conversations", "donor_requests",
             "donor_interval_s", "donor_max_tokens")


def load_live(path: Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no bench_node records; run `.venv/bin/python "
                                f"scripts/bench_node.py --quick --out {path.parent}` (about 8 min)")
    live = json.loads(path.read_text())
    for key in ("plan", "tables", "records", "summary"):
        if key not in live:
            raise ValueError(f"{path}: not a bench_node record file (no {key!r})")
    return live


def check_same_plan(cal: dict, live: dict) -> None:
    diff = {k: (cal["plan"].get(k), live["plan"].get(k)) for k in PLAN_KEYS
            if cal["plan"].get(k) != live["plan"].get(k)}
    if diff:
        raise ValueError(f"the calibration traced another plan than the live run ({diff}, "
                         f"calibration vs live); rerun scripts/calibrate_cpu.py --plan quick|full "
                         f"to match")


def trace_matches(cal: dict, live: dict) -> dict:
    """Does the traced workload equal the live one? Prompt tokens per (session, turn) of the
    busy steady phase (they depend on every earlier greedy answer)."""
    traced = {(t["session"], t["turn"]): len(t["prompt_ids"]) for t in cal["trace"]["busy"]}
    live_recs = live["records"]["a"]["busy"]
    bad = [(r["session"], r["turn"], r["prompt_tokens"], traced.get((r["session"], r["turn"])))
           for r in live_recs if traced.get((r["session"], r["turn"])) != r["prompt_tokens"]]
    return {"compared": len(live_recs), "mismatched": bad}


def _err(sim, live) -> float | None:
    if sim is None or not live:
        return None
    return round(abs(sim - live) / live, 4)


def per_request(sim_records: list, live_records: list) -> list[dict]:
    """Busy steady-phase requests side by side (session, turn): cached tokens and TTFT."""
    sim = {(r.session, r.turn): r for r in sim_records}
    rows = []
    for lr in live_records:
        sr = sim.get((lr["session"], lr["turn"]))
        rows.append({"session": lr["session"], "turn": lr["turn"], "prompt": lr["prompt_tokens"],
                     "cached_live": lr["cached_tokens"],
                     "cached_sim": sr.cached_tokens if sr else None,
                     "ttft_live_ms": round(lr["ttft"] * 1e3, 1),
                     "ttft_sim_ms": (round(sr.ttft * 1e3, 1)
                                     if sr and sr.ttft is not None else None)})
    return rows


def validate(cal_path: Path, live_path: Path, demote_ahead: float = 0.0) -> dict:
    """`demote_ahead`: the borrower's demote-ahead headroom in the live run's code (0 since commit
    0be01c3; 0.125 before it)."""
    cal = cpu_calibration.load(cal_path)
    live = load_live(live_path)
    check_same_plan(cal, live)
    sim = simulate_node(cal, live["plan"], demote_ahead)
    runs, errors = {}, {}
    for key, name in RUN_NAMES.items():
        lt, st = live["tables"][key], sim[key]["tables"]
        lb, sb = lt["busy"], st["busy"]
        errors[name] = {"ttft_p50_error": _err(sb["ttft_p50_ms"], lb["ttft_p50_ms"]),
                        "ttft_p99_error": _err(sb["ttft_p99_ms"], lb["ttft_p99_ms"]),
                        "cached_tokens_error": _err(sb["cached_tokens"], lb["cached_tokens"])}
        live_pools = live["summary"]["pools"][key]
        runs[name] = {"live": lt, "sim": {k: v for k, v in st.items()},
                      "pools": {"sim": [sim[key]["busy_pool"], sim[key]["donor_pool"]],
                                "live": [live_pools["busy"], live_pools["donor"]]},
                      "requests": per_request(sim[key]["records"]["busy"],
                                              live["records"][key]["busy"])}

    def overall(metric):
        vals = [e[metric] for e in errors.values() if e[metric] is not None]
        return round(sum(vals) / len(vals), 4) if vals else None

    kv_bytes_per_token = cal["models"]["busy"]["kv_bytes_per_token"]
    return {"simulated_vs_live": True, "calibration": str(cal_path), "live": str(live_path),
            "calibration_date": cal["date"], "live_date": live["summary"].get("date"),
            "demote_ahead": demote_ahead,
            "copied_tokens_sim": {RUN_NAMES[k]: {route: round(b / kv_bytes_per_token)
                                                for route, b in sim[k]["copied_bytes"].items()}
                                  for k in sim},
            "loadavg_1min": {"calibration": cal["loadavg_1min"],
                             "live": live["summary"].get("loadavg_1min")},
            "trace": trace_matches(cal, live), "runs": runs, "errors": errors,
            "ttft_p50_error": overall("ttft_p50_error"),
            "ttft_p99_error": overall("ttft_p99_error"),
            "cached_tokens_error": overall("cached_tokens_error")}


def _n(v, fmt="{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def format_tables(res: dict) -> str:
    load = res["loadavg_1min"]
    lines = [f"Simulated (calibration {res['calibration_date']}, load {load['calibration']}) "
             f"against live bench_node ({res['live_date']}, load {load['live']}); busy model, "
             f"steady phase",
             "", "| run | cached tokens live / sim | err | TTFT P50 ms live / sim | err "
             "| TTFT P99 ms live / sim | err |",
             "|---|---|---|---|---|---|---|"]
    pct = "{:.1%}"
    for name, r in res["runs"].items():
        lb, sb, e = r["live"]["busy"], r["sim"]["busy"], res["errors"][name]
        lines.append(f"| {name} | {lb['cached_tokens']} / {sb['cached_tokens']} "
                     f"| {_n(e['cached_tokens_error'], pct)} "
                     f"| {_n(lb['ttft_p50_ms'])} / {_n(sb['ttft_p50_ms'])} "
                     f"| {_n(e['ttft_p50_error'], pct)} "
                     f"| {_n(lb['ttft_p99_ms'])} / {_n(sb['ttft_p99_ms'])} "
                     f"| {_n(e['ttft_p99_error'], pct)} |")
    lines += ["", "Per turn (cached tokens; TTFT P50 / P99 ms), live | simulated:", "",
              "| turn | prompt | " + " | ".join(res["runs"]) + " |",
              "|---|---|" + "---|" * len(res["runs"])]
    turns = [row["turn"] for row in next(iter(res["runs"].values()))["live"]["busy_per_turn"]]
    for i, t in enumerate(turns):
        cells = []
        for r in res["runs"].values():
            lv, sv = r["live"]["busy_per_turn"][i], r["sim"]["busy_per_turn"][i]
            cells.append(f"{lv['cached_tokens']}; {_n(lv['ttft_p50_ms'])} / "
                         f"{_n(lv['ttft_p99_ms'])} | "
                         f"{sv['cached_tokens']}; {_n(sv['ttft_p50_ms'])} / "
                         f"{_n(sv['ttft_p99_ms'])}")
        prompt = r["live"]["busy_per_turn"][i]["prompt_tokens"]
        lines.append(f"| {t} | {prompt} | " + " | ".join(cells) + " |")
    lines += ["", "| run | donor light TTFT P50 / P99 ms, live | simulated |", "|---|---|---|"]
    for name, r in res["runs"].items():
        ld, sd = r["live"]["donor"], r["sim"]["donor"]
        lines.append(f"| {name} | {_n(ld['ttft_p50_ms'])} / {_n(ld['ttft_p99_ms'])} | "
                     f"{_n(sd['ttft_p50_ms'])} / {_n(sd['ttft_p99_ms'])} |")
    lines.append(
        "\nPer request, live TTFT / simulated TTFT (median; the run's first request): "
        + ", ".join(f"{name} {_ratio_median(r['requests']):.2f} "
                    f"({r['requests'][0]['ttft_live_ms'] / r['requests'][0]['ttft_sim_ms']:.2f})"
                    for name, r in res["runs"].items()))
    lines.append("Simulated copies (busy tokens): " + ", ".join(
        f"{name} {v}" for name, v in res["copied_tokens_sim"].items() if v))
    tr = res["trace"]
    lines.append(f"\ntraced workload = live workload: "
                 f"{tr['compared'] - len(tr['mismatched'])}/{tr['compared']} "
                 f"busy prompts of equal length")
    return "\n".join(lines)


def _ratio_median(rows: list[dict]) -> float:
    import statistics

    return statistics.median(r["ttft_live_ms"] / r["ttft_sim_ms"] for r in rows if r["ttft_sim_ms"])


def summary_line(res: dict) -> dict:
    return {"simulated_vs_live": True, "ttft_p50_error": res["ttft_p50_error"],
            "cached_tokens_error": res["cached_tokens_error"],
            "ttft_p99_error": res["ttft_p99_error"], "per_run": res["errors"],
            "calibration_date": res["calibration_date"], "live_date": res["live_date"],
            "trace_matches_live": not res["trace"]["mismatched"]}
