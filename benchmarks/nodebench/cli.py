"""The node benchmark with capacity-equal baselines (scripts/bench_node.py).

    python scripts/bench_node.py [--quick] [--busy-tp N] [--out runs/node_bench] [--plot PNG]

Two models on one node, three runs of the same traffic (see plan.py and traffic.py): (a) stock
SGLang, (b) SwiftCache with the donor lending from its pool, (c) stock SGLang with what (b) lent
moved into the busy server's own pool; the three runs' servers stay up together, each run's
steady phase goes alone, the donors' bursts go in rounds, the three back to back. Prints per run
and model the cached tokens and TTFT (per turn for the busy model), whether every output equals
stock's, the donor's reclaims, and last a JSON object (keys defined in report.summarize). Exit
status 1 when an output differs from stock.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import time
from dataclasses import replace
from pathlib import Path

from ..tools.tiny_model import ensure_tiny_model
from .plan import ModelFacts, NodePlan
from .report import (
    burst_rounds_in_trace,
    burst_split,
    compare_outputs,
    format_run,
    noise_floor,
    plot_capacity,
    reclaim_view,
    run_tables,
    summarize,
)
from .runner import forward_trace_path, run_node
from .traffic import build_traffic

OVERRIDES = ("conversations", "turns", "busy_pool", "donor_pool", "lend_fraction",
             "burst_requests", "burst_fraction", "burst_rounds", "donor_requests",
             "server_threads")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, NodePlan]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="4 steady turns, 16 light donor requests (about 5 min on a 2-core "
                         "CPU machine, more on a slower one; the seven servers' start-ups take "
                         "about half)")
    ap.add_argument("--no-twin", action="store_true",
                    help="without the second stock donor (t) whose bursts measure the noise "
                         "floor (donor_ttft_p99_noise)")
    ap.add_argument("--out", type=Path, default=Path("runs/node_bench"),
                    help="server logs and node_bench.json (every request) go here")
    ap.add_argument("--diagnose", action="store_true",
                    help="also write each server's forward passes (wall and thread CPU ms) to "
                         "OUT/<run>-<role>.forward.jsonl, the CPU seconds of every server "
                         "thread per traffic phase to OUT/<run>-cpu.json, and log SGLang's "
                         "per-request queue and forward durations (ReqTimeStats) and garbage "
                         "collections over 50 ms (LONG GARBAGE COLLECTION) in the server logs")
    ap.add_argument("--plot", type=Path, default=None,
                    help="the capacity plot (default: OUT/capacity.png)")
    ap.add_argument("--busy-tp", type=int, default=1, metavar="N",
                    help="run every busy server (stock, SwiftCache, the ideal) with --tp N, "
                         "each rank on its own core (the donor stays at TP 1); N must split "
                         "the busy model's KV heads evenly. Pools stay per rank, as SGLang "
                         "sizes them with --max-total-tokens (docs/node_bench.md)")
    from .closed_loop import add_arguments

    add_arguments(ap)
    defaults = NodePlan()
    for name in OVERRIDES:
        kind = type(getattr(defaults, name))
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                        help=f"override the plan's {name} (default {getattr(defaults, name)}, "
                             f"--quick {getattr(NodePlan.quick(), name)})")
    args = ap.parse_args(argv)
    if args.busy_tp < 1:
        ap.error(f"--busy-tp must be at least 1, got {args.busy_tp}")
    plan = NodePlan.quick() if args.quick else NodePlan()
    plan = replace(plan, busy_tp=args.busy_tp)
    try:
        plan = replace(plan, **{k: getattr(args, k) for k in OVERRIDES
                                if getattr(args, k) is not None})
    except ValueError as exc:
        ap.error(str(exc))
    return args, plan


def _burst_splits(sides: dict, out: Path) -> dict:
    """--diagnose: each donor's bursts (`sides`: {key: (RunSpec, records)}), round by round,
    split into their prefill passes and the rest (report.burst_split)."""
    split = {}
    for key, (spec, records) in sides.items():
        path = forward_trace_path(out, spec, "donor")
        trace = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
            if path.exists() else []
        by_round: dict[int, list] = {}
        for rec in records["burst"]:
            by_round.setdefault(rec.turn, []).append(rec)
        rounds = [by_round[t] for t in sorted(by_round)]
        tokens = [sum((x.prompt_tokens or 0) - (x.cached_tokens or 0) for x in recs)
                  for recs in rounds]
        split[key] = [burst_split(_slowest_ttft_ms(recs), passes)
                      for recs, passes in zip(rounds, burst_rounds_in_trace(trace, tokens))]
    return split


def _burst_cpu(out: Path) -> dict[str, dict[str, float]]:
    """--diagnose: per run, the mean CPU ms of every server during that run's bursts
    (runner._server_cpu_s readings around each burst, OUT/burst-cpu.json)."""
    path = out / "burst-cpu.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    means: dict[str, dict[str, float]] = {}
    for key in sorted({row["run"] for row in rows}):
        mine = [row["cpu_ms"] for row in rows if row["run"] == key]
        means[key] = {server: round(sum(m[server] for m in mine) / len(mine), 1)
                      for server in mine[0]}
    return means


def _slowest_ttft_ms(records: list) -> float | None:
    ttfts = [r.ttft for r in records if r.ttft is not None]
    return 1e3 * max(ttfts) if ttfts else None


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds the runs, so their servers are stopped


def main(argv: list[str] | None = None) -> int:
    args, plan = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.monotonic()
    busy_model, donor_model = ensure_tiny_model(shape="small"), ensure_tiny_model(shape="tiny")
    facts = {"busy": ModelFacts.from_dir(busy_model), "donor": ModelFacts.from_dir(donor_model)}
    try:
        plan.check_busy_tp(facts["busy"])
    except ValueError as exc:
        raise SystemExit(f"bench_node.py: error: {exc}") from None
    if args.closed_loop:
        from . import closed_loop

        out = args.out if args.out != Path("runs/node_bench") else Path("runs/closed_loop")
        return closed_loop.main(args, plan, out,
                                plan.lendable_busy_tokens(facts["busy"], facts["donor"]))
    for role, f in facts.items():
        print(f"{role} model  {f.describe()}")
    traffic = build_traffic(plan, donor_model / "tokenizer.json")
    max_borrow = plan.lendable_busy_tokens(facts["busy"], facts["donor"])
    print(f"busy: {len(traffic.busy)} ShareGPT conversations x {plan.turns} turns "
          f"({plan.busy_requests} requests) + 1 turn after the bursts, pool {plan.busy_pool} "
          f"tokens; donor: pool "
          f"{plan.donor_pool} tokens, lends {plan.lend_fraction:.0%} (= {max_borrow} busy "
          f"tokens), {plan.donor_requests} light requests, {plan.burst_rounds} bursts of "
          f"{plan.burst_requests} x {plan.burst_tokens_each} tokens, each in one batched call"
          + (f"; every busy server --tp {plan.busy_tp} (pools per rank)" if plan.busy_tp > 1
             else ""), flush=True)

    runs, twin = run_node(plan, busy_model, donor_model, traffic, args.out, max_borrow,
                          diagnose=args.diagnose, twin=not args.no_twin,
                          log=lambda line: print(line, flush=True))
    b = runs["b"]

    tables = {k: run_tables(r.records) for k, r in runs.items()}
    outputs = {k: compare_outputs(runs["a"].records, r.records) for k, r in runs.items()}
    reclaim = reclaim_view(b.sampler, b.marks.bursts, b.round_reclaims or None)
    latency = round(b.reclaim_latency_sum_s / b.reclaims, 4) if b.reclaims else None
    summary = summarize(tables, outputs, reclaim, latency)
    summary.update(noise_floor(tables, twin))
    if plan.busy_tp > 1:
        summary["busy_tp"] = plan.busy_tp
    summary.update(
        donor_own_pages_wait_ms=b.own_pages_wait_ms,
        reclaims=b.reclaims, donor_full_after_burst_s=reclaim["full_after_s"],
        pools={k: r.pools for k, r in runs.items()},
        busy_flops_per_kv_byte=round(facts["busy"].flops_per_kv_byte),
        donor_flops_per_kv_byte=round(facts["donor"].flops_per_kv_byte),
        loadavg_1min={k: [round(r.loadavg[0][0], 2), round(r.loadavg[1][0], 2)]
                      for k, r in runs.items()},
        wall_s=round(time.monotonic() - started), quick=args.quick,
        date=datetime.date.today().isoformat(), device=f"CPU only ({os.cpu_count()} cores)")

    print(f"\nTimings on {platform.machine()} CPU; busy model "
          f"{facts['busy'].flops_per_kv_byte / 1e3:.2f} kFLOP per KV byte, donor "
          f"{facts['donor'].flops_per_kv_byte / 1e3:.2f} kFLOP per KV byte")
    for key, r in runs.items():
        print(format_run(f"({key}) {r.spec.name}: busy pool {r.pools['busy']}, donor pool "
                         f"{r.pools['donor']}", tables[key]))
        print(f"outputs equal to (a): {outputs[key]['matched']}/{outputs[key]['compared']}")
        for role, lines in r.alerts.items():
            for line in lines:
                print(f"  log alert ({role}): {line}")
    if twin is not None:
        print(f"(t) {twin.spec.name}: donor pool {twin.spec.donor_pool}, bursts only: burst TTFT "
              f"P99 {summary['donor_burst_p99_ms']['t']} ms against (a)'s "
              f"{summary['donor_burst_p99_ms']['a']} ms: donor_ttft_p99_noise "
              f"{summary['donor_ttft_p99_noise']}")
    means = summary["donor_burst_mean_ms"]
    print("donor burst TTFT mean, ms: " + ", ".join(f"({k}) {v}" for k, v in means.items())
          + f"; (b) / (a) {summary['donor_burst_mean_ratio']}"
          + (f", twin (t) / (a) {summary['donor_burst_mean_noise']}" if twin is not None else ""))
    if args.diagnose:
        sides = {k: (r.spec, r.records) for k, r in runs.items()}
        if twin is not None:
            sides["t"] = (twin.spec, twin.records)
        split = _burst_splits(sides, args.out)
        summary["donor_burst_split"] = split
        print("donor bursts, round by round: TTFT ms = prefill passes' wall ms (their CPU ms) "
              "+ ms outside them")
        for key, rounds in split.items():
            print(f"  ({key}) " + "; ".join(
                f"{v['ttft_ms']:.0f} = {v['forward_wall_ms']:.0f} ({v['forward_cpu_ms']:.0f}) "
                f"+ {v['outside_ms']:.0f}" if v else "-" for v in rounds))
        beside = _burst_cpu(args.out)
        summary["burst_cpu_ms"] = beside
        print("CPU ms of each server during a run's burst (mean over its rounds):")
        for key, per_server in beside.items():
            print(f"  ({key}) " + ", ".join(f"{k} {v:.1f}" for k, v in per_server.items()))
    print(f"donor reclaim in (b): {b.reclaims} reclaim(s) in {plan.burst_rounds} rounds, mean "
          f"latency {latency} s (demand to last page back); the donor's scheduler waited "
          f"{b.own_pages_wait_ms} ms for its lent pages, round by round; lent at each burst "
          f"{[r['lent_at_burst'] for r in reclaim['rounds']]}, usable back to the whole pool "
          f"{[r['full_after_s'] for r in reclaim['rounds']]} s after each burst began (sampled)")

    args.out.mkdir(parents=True, exist_ok=True)
    plot = args.plot or args.out / "capacity.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    plot_capacity(plot, runs, facts)
    detail = {"summary": summary, "plan": plan.__dict__, "reclaim": reclaim, "tables": tables,
              "outputs": outputs,
              "capacity": {k: r.sampler.samples for k, r in runs.items()},
              "marks": {k: r.marks.__dict__ for k, r in runs.items()},
              "records": {k: {s: [x.to_json() for x in recs] for s, recs in r.records.items()}
                          for k, r in runs.items()},
              "ctl_status": b.ctl_status,
              "twin_records": {s: [x.to_json() for x in recs]
                               for s, recs in (twin.records.items() if twin else ())}}
    (args.out / "node_bench.json").write_text(json.dumps(detail, indent=1, default=str))
    print(f"plot: {plot}; every request: {args.out / 'node_bench.json'}")
    print(json.dumps(summary))
    return 0 if summary["identical"] else 1
