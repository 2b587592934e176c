"""Which figures of a simulated-vs-live bench_tiers comparison validate the simulator, and which
only check its consistency; pure Python, so a page can re-derive them from a record.

The simulator replays bench_tiers' trace through the same `radix_ext` code the live SwiftCache
server runs, so where the live server's cache is that code too, equal cached tokens are expected
by construction and say nothing about the model of time or of SGLang's own cache:

- validation (what the simulator does not share with the live code): HiCache's cached tokens
  (stock HiCache's radix cache, not radix_ext), the TTFT P50 and P99 of every run (the time
  model, from the calibration), and SwiftCache's hits by tier (where the tokens came from); each
  with its error |simulated - live| / live, every one counting toward the 20% target;
- consistency check (shared code on the same trace): the cached tokens of stock, SwiftCache and
  the upper bound (u: one stock pool of device + lent + host tokens, a stock pool without lower
  tiers like stock's), expected equal.

Records made before the upper bound hold bench_tiers' older baseline run, `ideal` (i): HiCache
with the lent tokens added to its device pool, not an upper bound. Its figures are shown under
that name, labelled as the older baseline (`OLDER_BASELINE`), never as the upper bound.

    python -m benchmarks.simulator.validation_figures docs/records/simulate_validate_tiers.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGET = 0.20
VALIDATION_CACHED = ("hicache",)  # runs whose cached tokens come from code the simulator lacks
CONSISTENCY_CACHED = ("stock", "hicache+swiftcache", "upper bound", "ideal")
OLDER_BASELINE = "ideal"  # run (i) of older records; shown as LABELS says
LABELS = {OLDER_BASELINE: "ideal (older baseline)"}
OLDER_BASELINE_NOTE = ("ideal (older baseline): run (i) of a record made before the upper bound, "
                       "HiCache with the lent tokens added to its device pool and (h)'s host "
                       "tier; not an upper bound")
HITS_RUN = "hicache+swiftcache"
TTFT = (("ttft_p50_ms", "TTFT P50"), ("ttft_p99_ms", "TTFT P99"))


def error(sim: float | None, live: float | None) -> float | None:
    """|sim - live| / live; None where it is undefined (a figure missing, live 0 and sim not)."""
    if sim is None or live is None:
        return None
    if live == 0:
        return 0.0 if sim == 0 else None
    return round(abs(sim - live) / live, 4)


def derive(figures: dict, hits_by_tier: dict | None) -> dict:
    """`figures`: per run, {metric: {"live": x, "sim": y}} (cached_tokens, ttft_p50_ms,
    ttft_p99_ms); `hits_by_tier`: SwiftCache's tokens by tier, {"live": {...}, "sim": {...}}.
    Returns the validation figures with their errors, whether each and all are within TARGET,
    the largest error, and the consistency check."""
    rows: dict[str, dict] = {}

    def add(name: str, live, sim) -> None:
        rows[name] = {"live": live, "sim": sim, "error": error(sim, live)}

    for run in VALIDATION_CACHED:
        if run in figures:
            c = figures[run]["cached_tokens"]
            add(f"{run} cached tokens", c["live"], c["sim"])
    for run, per in figures.items():
        for metric, label in TTFT:
            if metric in per:
                add(f"{LABELS.get(run, run)} {label} (ms)", per[metric]["live"],
                    per[metric]["sim"])
    hits = hits_by_tier or {}
    live_hits, sim_hits = hits.get("live") or {}, hits.get("sim") or {}
    for tier in sorted(set(live_hits) | set(sim_hits)):
        lv, sv = live_hits.get(tier, 0), sim_hits.get(tier, 0)
        if lv or sv:  # a tier neither side used (L3 here) has nothing to compare
            add(f"{HITS_RUN} hits from {tier} (tokens)", lv, sv)
    within = {n: r["error"] is not None and r["error"] <= TARGET for n, r in rows.items()}
    errors = [(r["error"], n) for n, r in rows.items() if r["error"] is not None]
    worst = max(errors) if errors else (None, None)
    consistency = {}
    for run in CONSISTENCY_CACHED:
        if run in figures:
            c = figures[run]["cached_tokens"]
            consistency[f"{LABELS.get(run, run)} cached tokens"] = {
                "live": c["live"], "sim": c["sim"], "equal": c["live"] == c["sim"]}
    return {"validation": rows, "within_20pct": within,
            "all_within_20pct": bool(within) and all(within.values()),
            "largest_error": {"figure": worst[1], "error": worst[0]},
            "consistency_check": consistency}


def from_result(result: dict) -> dict:
    """The same, from a record's result (its `figures` and `hits_by_tier`)."""
    return derive(result.get("figures") or {}, result.get("hits_by_tier"))


def format_table(derived: dict) -> str:
    lines = ["Validation (figures the simulator does not share with the live code; target: "
             f"every error within {TARGET:.0%}):", "",
             "| figure | live | simulated | error | within 20% |", "|---|---|---|---|---|"]
    for name, r in derived["validation"].items():
        err = "-" if r["error"] is None else f"{r['error']:.1%}"
        lines.append(f"| {name} | {_num(r['live'])} | {_num(r['sim'])} | {err} | "
                     f"{'yes' if derived['within_20pct'][name] else 'no'} |")
    worst = derived["largest_error"]
    lines += ["", f"all within 20%: {derived['all_within_20pct']}; largest error "
                  f"{worst['error']} ({worst['figure']})", "",
              "Consistency check, not validation (the same radix_ext code replays the same "
              "trace, so equal is expected): " + ", ".join(
                  f"{n} live {c['live']} / simulated {c['sim']}"
                  + ("" if c["equal"] else " DIFFERENT")
                  for n, c in derived["consistency_check"].items())]
    if any(n.startswith(LABELS[OLDER_BASELINE]) for n in derived["consistency_check"]):
        lines += ["", OLDER_BASELINE_NOTE + "."]
    return "\n".join(lines)


def _num(v) -> str:
    return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    paths = argv if argv is not None else sys.argv[1:]
    if len(paths) != 1:
        print(__doc__.splitlines()[-1].strip(), file=sys.stderr)
        return 2
    data = json.loads(Path(paths[0]).read_text())
    derived = from_result(data.get("result", data))
    print(format_table(derived))
    print(json.dumps(derived))
    return 0


if __name__ == "__main__":
    sys.exit(main())
