"""`scripts/bench_tiers.py`: the hierarchy (device, donor pages, host) against HiCache and an
upper bound, at the same memory per server; see plan.py for the runs and docs/hierarchy.md for
the keys. The last line printed is the JSON summary; `--out` keeps every request's record.

Summary keys:
- `identical`: every busy output of (s) equals stock SGLang's (r), greedy, request by request,
  in its token ids, over the requests compared (at least one); `compared`: per run, the
  requests that it or (r) answered; `empty_in_both`: per run, the requests neither it nor (r)
  answered (a prompt longer than both pools allow): not compared, so neither a match nor a
  difference; `mismatches`: per run, the compared outputs that differ from (r)'s: the upper
  bound (u) differs where its larger pool serves what the plan's `busy_pool` cannot (a prompt
  longer than the pool is refused with an empty answer, an answer stops where the pool is full),
  and any HiCache run could differ at a float near-tie (its cached prefixes change the
  prefill's arithmetic);
- `cached_tokens`: per run, prompt tokens the busy server served from cache (any tier);
  `cached_vs_hicache` = (s) / (h); `cached_vs_upper_bound` = (s) / (u), at most 1 unless
  something is wrong: above 1, `upper_bound_exceeded` says by how much, in which turns, and
  why (printed too); `hicache_cached_vs_upper_bound` = (h) / (u); `upper_bound_pool_tokens`:
  (u)'s one pool;
- `ttft_p50_vs_hicache`, `ttft_p99_vs_hicache`: (s) / (h) over the busy requests; beside them
  `ttft_p50_noise`, `ttft_p99_noise`: the twin (t) / (h), what two identical runs differ by;
  `ttft_p50_vs_upper_bound`, `ttft_p99_vs_upper_bound`: (s) / (u);
  `ttft_p99_upper_bound_vs_hicache`: (u) / (h);
- `hits_by_tier`: (s)'s cached tokens by where they came from (device, donor, host, L3: the
  tokens fetched from storage, `--l3` only);
- `cached_by_turn`: per run, the busy server's cached tokens turn by turn (the burst comes after
  turn `burst_after_turn`, and every run pauses `pause_after_burst_s` before the next turn);
  `relent_after_burst`: whether (s)'s donor lent again before the turns resumed after that pause,
  `borrowed_at_end`: whether (s) held donor memory at the end;
- `recomputed_after_reclaim_tokens`: tokens in (s)'s donor tier when the donor's burst reclaimed
  every lent page that a later request prefilled again; `rescued_tokens`: those the reclaim moved
  into host instead; `spilled_tokens`: those it wrote straight to L3 when host had no room
  (`--l3` only); `history_tokens`: the busy model's histories at the end, against
  `device_plus_host_tokens`;
- `reclaim_overflow_tokens`: tokens (s)'s tree held, when the reclaim came, beyond what its
  device pool, host tier and remaining donor pages could hold once the lent pages were gone: at
  least that many had to leave the tiers (to L3, else dropped) under any placement, so without
  L3 `recomputed_after_reclaim_tokens` can reach 0 only when it is 0 (or what was dropped is
  never asked for again); `revoked_tokens`: what the reclaim did drop;
- `donor_to_host_tokens`: tokens (s)'s evictions pushed out of the full lease and moved into
  host; `donor_to_l3_tokens`: those no tier below took, written to L3 instead (`--l3` only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..loadgen.stats import pct
from ..nodebench.plan import ModelFacts
from ..nodebench.report import same_output
from ..tools.tiny_model import ensure_tiny_model
from ..workloads.sharegpt import load_conversations
from .plan import FULL, NAMES, QUICK, RUNS, servers
from .runner import run_one


def _ratio(a, b):
    return None if a is None or not b else a / b


def history_tokens(records) -> int:
    """The busy model's histories at the end: each session's last prompt plus its answer."""
    last = {}
    for r in records:
        last[r.session] = (r.prompt_tokens or 0) + (r.completion_tokens or 0)
    return sum(last.values())


def upper_bound_exceeded(cached: dict, by_turn: dict) -> dict | None:
    """Why (s) cached more than (u), or None where it did not. Every run sends the same prompts
    (the histories carry (r)'s answers) one at a time, so neither the prompts nor their order
    can differ between the two runs; what is left: the order of evictions (SGLang's LRU over
    one pool is not the best possible order, and SwiftCache's tiers evict and demote in
    another) or a miscount of cached tokens (a bug), which `hits_by_tier` and the turns below
    locate."""
    s, u = cached.get("s"), cached.get("u")
    if s is None or u is None or s <= u:
        return None
    turns = [t + 1 for t, (a, b) in enumerate(zip(by_turn["s"], by_turn["u"])) if a > b]
    return {"by_tokens": s - u, "turns": turns,
            "why": "same prompts in the same order in both runs (no nondeterminism in what is "
                   "asked): either SwiftCache's eviction order kept prefixes that SGLang's LRU "
                   "over one pool of the same memory dropped (LRU is no optimum, so this bound "
                   "holds for LRU placement only), or SwiftCache over-counts cached tokens (a "
                   "bug: check hits_by_tier against these turns)"}


def summarize(plan, results: dict, busy: ModelFacts) -> dict:
    ref = {(r.session, r.turn): r.output_ids for r in results["r"].records}
    empty_in_both = {run: sum(1 for r in res.records
                              if not r.output_ids and not ref.get((r.session, r.turn)))
                     for run, res in results.items() if run != "r"}
    compared = {run: len(res.records) - empty_in_both[run]
                for run, res in results.items() if run != "r"}
    mismatches = {run: sum(1 for r in res.records
                           if not same_output(r.output_ids, ref.get((r.session, r.turn))))
                  - empty_in_both[run]  # same_output counts an answer empty in both as differing
                  for run, res in results.items() if run != "r"}
    cached = {run: sum(r.cached_tokens or 0 for r in res.records) for run, res in results.items()}
    ttft = {run: [r.ttft * 1e3 for r in res.records if r.ttft is not None]
            for run, res in results.items()}
    by_turn = {}
    for run, res in results.items():
        turns = [0] * plan.turns
        for r in res.records:
            turns[r.turn - 1] += r.cached_tokens or 0
        by_turn[run] = turns
    p50 = {run: pct(v, 50) for run, v in ttft.items()}
    p99 = {run: pct(v, 99) for run, v in ttft.items()}
    out = {"identical": mismatches.get("s") == 0 and compared.get("s", 0) > 0,
           "mismatches": mismatches, "compared": compared, "empty_in_both": empty_in_both,
           "cached_tokens": cached, "cached_by_turn": by_turn,
           "cached_vs_hicache": _ratio(cached.get("s"), cached.get("h")),
           "cached_vs_upper_bound": _ratio(cached.get("s"), cached.get("u")),
           "hicache_cached_vs_upper_bound": _ratio(cached.get("h"), cached.get("u")),
           "upper_bound_exceeded": upper_bound_exceeded(cached, by_turn),
           "ttft_p50_ms": p50, "ttft_p99_ms": p99,
           "ttft_p50_vs_hicache": _ratio(p50.get("s"), p50.get("h")),
           "ttft_p99_vs_hicache": _ratio(p99.get("s"), p99.get("h")),
           "ttft_p50_noise": _ratio(p50.get("t"), p50.get("h")),
           "ttft_p99_noise": _ratio(p99.get("t"), p99.get("h")),
           "ttft_p50_vs_upper_bound": _ratio(p50.get("s"), p50.get("u")),
           "ttft_p99_vs_upper_bound": _ratio(p99.get("s"), p99.get("u")),
           "ttft_p99_upper_bound_vs_hicache": _ratio(p99.get("u"), p99.get("h"))}
    s = results.get("s")
    if s is not None:
        m = s.metrics
        donor = int(m.get("swiftcache_donor_hit_tokens_total", 0))
        host = int(m.get("swiftcache_host_hit_tokens_total", 0))
        l3 = int(m.get("swiftcache_l3_fetched_tokens_total", 0))
        out["hits_by_tier"] = {"device": cached["s"] - donor - host, "donor": donor,
                               "host": host - l3, "l3": l3}
        out["relent_after_burst"] = s.relent_before_resume
        out["borrowed_at_end"] = m.get("swiftcache_borrowed_tokens", 0) > 0
        out["recomputed_after_reclaim_tokens"] = int(
            m.get("swiftcache_recomputed_after_reclaim_tokens_total", 0))
        out["rescued_tokens"] = int(m.get("swiftcache_rescued_tokens_total", 0))
        out["spilled_tokens"] = int(m.get("swiftcache_spilled_tokens_total", 0))
        out["donor_to_host_tokens"] = int(m.get("swiftcache_donor_to_host_tokens_total", 0))
        out["donor_to_l3_tokens"] = int(m.get("swiftcache_donor_to_l3_tokens_total", 0))
        out["revoked_tokens"] = int(m.get("swiftcache_revoked_tokens_total", 0))
        out["reclaim_overflow_tokens"] = int(
            m.get("swiftcache_reclaim_overflow_tokens_total", 0))
        out["reclaims"] = int(m.get("swiftcache_reclaims_total", 0))
        out["loads_failed"] = int(m.get("swiftcache_loads_failed_total", 0))
    out["history_tokens"] = history_tokens(results["r"].records)
    out["device_plus_host_tokens"] = plan.busy_pool + plan.host_tokens()
    if "u" in results:
        out["upper_bound_pool_tokens"] = results["u"].pools["busy"]
    out["busy_model"] = busy.describe()
    out["wall_s"] = {run: round(res.wall_s, 1) for run, res in results.items()}
    out["loadavg"] = {run: [round(x, 2) for x in res.loadavg[0] + res.loadavg[1]]
                      for run, res in results.items()}
    return out


def table(summary: dict) -> str:
    lines = [f"{'run':<20} {'cached tok':>10} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
             f"{'mismatches':>10}"]
    for run in RUNS:
        if run not in summary["cached_tokens"]:
            continue
        lines.append(f"{run + ' ' + NAMES[run]:<20} {summary['cached_tokens'][run]:>10} "
                     f"{summary['ttft_p50_ms'][run]:>11.1f} {summary['ttft_p99_ms'][run]:>11.1f} "
                     f"{summary['mismatches'].get(run, 0):>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the quick plan (default)")
    size.add_argument("--full", action="store_true", help="more conversations and turns")
    ap.add_argument("--conversations", type=int, help="override the plan's conversation count")
    ap.add_argument("--turns", type=int, help="override the plan's turns per conversation")
    ap.add_argument("--l3", choices=("file",), default=None,
                    help="give every HiCache run SGLang's L3 storage backend below its host "
                         "tier (each run its own empty store)")
    ap.add_argument("--write-policy", choices=("write_back", "write_through"),
                    default="write_back", help="every HiCache run's --hicache-write-policy "
                                               "(default %(default)s)")
    ap.add_argument("--pause-after-burst-s", type=float, default=None,
                    help="every run's pause after the donor's burst before the next turn, a "
                         "user's think time (default: the plan's, 15 s; 0: go on at once)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_tiers"),
                    help="directory for the server logs and the records (default %(default)s)")
    args = ap.parse_args(argv)
    plan = FULL if args.full else QUICK
    if args.conversations:
        plan = replace(plan, conversations=args.conversations)
    if args.turns:
        plan = replace(plan, turns=args.turns)
    if args.l3:
        plan = replace(plan, l3=args.l3)
    plan = replace(plan, write_policy=args.write_policy)
    if args.pause_after_burst_s is not None:
        if args.pause_after_burst_s < 0:
            ap.error(f"--pause-after-burst-s must not be negative; got {args.pause_after_burst_s}")
        plan = replace(plan, pause_after_burst_s=args.pause_after_burst_s)
    if plan.burst_after_turn >= plan.turns:
        ap.error(f"the burst comes after turn {plan.burst_after_turn}: give more turns")
    args.out.mkdir(parents=True, exist_ok=True)
    busy_dir, donor_dir = ensure_tiny_model(shape="small"), ensure_tiny_model(shape="tiny")
    busy, donor = ModelFacts.from_dir(busy_dir), ModelFacts.from_dir(donor_dir)
    print(f"busy: {busy.describe()}\ndonor: {donor.describe()}", flush=True)
    convs = load_conversations(plan.conversations, min_turns=plan.turns,
                               max_chars_per_message=plan.max_chars)
    rendezvous = str((args.out / "rendezvous").resolve())
    results = {}
    forced = None
    t0 = time.monotonic()
    for run in RUNS:
        bound = None
        if run == "u":  # sized by what (s) had: its host tier as SGLang built it, the histories
            host = results["s"].metrics.get("swiftcache_host_capacity_tokens", 0)
            bound = plan.bound_pool(busy, donor, int(host),
                                    history_tokens(results["r"].records))
        spec = servers(run, plan, busy_dir, donor_dir, rendezvous, busy, donor,
                       store=(args.out / f"l3-{run}").resolve(), bound_pool=bound)
        print(f"[{run}] {NAMES[run]}: busy pool {spec['busy'].pool}, donor pool "
              f"{spec['donor'].pool} ...", flush=True)
        results[run] = run_one(run, spec, plan, convs, forced, args.out, rendezvous)
        if run == "r":
            forced = {(r.session, r.turn): r.text for r in results[run].records}
        print(f"[{run}] done in {results[run].wall_s:.0f}s", flush=True)
    summary = summarize(plan, results, busy)
    summary["total_wall_s"] = round(time.monotonic() - t0, 1)
    (args.out / "records.json").write_text(json.dumps(
        {"plan": plan.__dict__, "summary": summary,
         "records": {run: [r.to_json() for r in res.records] for run, res in results.items()},
         "metrics": {run: res.metrics for run, res in results.items()}}, indent=1))
    print(table(summary))
    over = summary["upper_bound_exceeded"]
    if over is not None:
        print(f"WARNING: SwiftCache cached {over['by_tokens']} tokens more than the upper bound "
              f"(turns {over['turns']}): {over['why']}", flush=True)
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
