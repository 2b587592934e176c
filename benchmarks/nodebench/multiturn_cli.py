"""`scripts/bench_multiturn.py`: SGLang's bench_multiturn.py traffic (`multiturn.py`) against
stock SGLang, a SwiftCache borrower and the ideal, with every request's phases (`phases.py`).

Servers (the busy model `small`, all up for the whole benchmark, started side by side):
- `stock`       stock SGLang, a `--busy-pool`-token pool;
- `swiftcache`  a borrower with the same pool, and its donor (`tiny`, `--donor-pool` tokens,
  lending `--lend-fraction` of them: `NodePlan.planned_loan` busy tokens), which serves nothing;
- `ideal`       stock SGLang whose one pool holds the busy pool and the loan;
- `ideal_twin`  the ideal again: the noise floor of a ratio against the ideal.
For every client count and seed the four take turns (the order rotated by one each time), each
after a `/flush_cache` and a second's pause (as the original between rates). Every busy server
writes its forward passes and the borrower its batch loads to OUT (the debug seam's traces), so
each request gets a timeline (`phases.timeline`).

Per client count, the last line's JSON has, as means over the seeds and for the worst seed:
`ttft_p99_vs_stock` (SwiftCache's TTFT P99 / stock's), `ttft_avg_vs_ideal`, `ttft_p99_vs_ideal`
(SwiftCache / the ideal), `twin_ttft_avg_vs_ideal`, `twin_ttft_p99_vs_ideal` (the twin / the
ideal), their spreads over the seeds (max - min), and `slowest_phase_p99` (SwiftCache's
sequential phase with the largest P99, beside stock's P99 of it) and
`phase_p99_excess_vs_stock` (the phase whose P99 exceeds stock's by the most).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path

from ..instruments import instruments_env
from ..instruments.work import breakdown, read_work
from ..loadgen.stats import pct
from ..tools.demo import wait_for_lease
from ..tools.local_server import start_all
from . import phases
from .closed_loop import SWIFT_STATS
from .multiturn import Prompts, Workload, drive
from .observe import parse_metrics
from .plan import ModelFacts, NodePlan, RunSpec
from .runner import bench_server

SYSTEMS = ("stock", "swiftcache", "ideal", "ideal_twin")
RATIOS = ("ttft_p99_vs_stock", "ttft_avg_vs_ideal", "ttft_p99_vs_ideal",
          "twin_ttft_avg_vs_ideal", "twin_ttft_p99_vs_ideal")


def specs(plan: NodePlan, loan: int, lent: int) -> dict[str, RunSpec]:
    ideal = plan.busy_pool + loan
    return {"stock": RunSpec("a", "stock", plan.busy_pool, plan.donor_pool, False),
            "swiftcache": RunSpec("b", "swiftcache", plan.busy_pool, plan.donor_pool, True),
            "ideal": RunSpec("c", "ideal", ideal, plan.donor_pool - lent, False),
            "ideal_twin": RunSpec("t", "ideal_twin", ideal, plan.donor_pool - lent, False)}


def _read_lines(path: Path, start: int) -> tuple[list[dict], int]:
    """JSON lines of `path` from byte `start`; and the new end."""
    if not path.exists():
        return [], start
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    lines = [json.loads(x) for x in data.decode().splitlines() if x.strip()]
    return lines, start + len(data)


def _post(url: str, path: str) -> None:
    req = urllib.request.Request(url + path, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def _swift_stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode(errors="replace"), SWIFT_STATS)


class Bench:
    """The servers, their trace files and what each run read from them."""

    def __init__(self, plan: NodePlan, busy_model: Path, donor_model: Path, out: Path,
                 loan: int, lent: int, max_borrow: int):
        self.out = out
        self.rendezvous = tempfile.mkdtemp(prefix="multiturn-")
        self.specs = specs(plan, loan, lent)
        self.busy = {}
        self.traces: dict[str, dict[str, Path]] = {}
        self.offsets: dict[Path, int] = {}
        for name, spec in self.specs.items():
            srv = bench_server(busy_model, spec, "busy", spec.busy_pool,
                               spec.busy_args(plan, self.rendezvous, max_borrow), plan, out,
                               False)
            paths = {"forward": out / f"{name}-busy.forward.jsonl",
                     "loads": out / f"{name}-busy.loads.jsonl"}
            for p in paths.values():
                p.unlink(missing_ok=True)
            srv.env = instruments_env(srv.env, forward_trace=str(paths["forward"].resolve()),
                                      load_trace=str(paths["loads"].resolve()))
            self.busy[name], self.traces[name] = srv, paths
        sw = self.specs["swiftcache"]
        self.donor = bench_server(donor_model, sw, "donor", sw.donor_pool,
                                  sw.donor_args(plan, self.rendezvous), plan, out, False)

    def start(self) -> None:
        start_all([*self.busy.values(), self.donor])
        wait_for_lease(self.rendezvous, timeout_s=300)

    def stop(self) -> None:
        for srv in [*self.busy.values(), self.donor]:
            srv.stop()

    def _new_lines(self, path: Path) -> list[dict]:
        lines, self.offsets[path] = _read_lines(path, self.offsets.get(path, 0))
        return lines

    def run(self, name: str, load: Workload, prompts: Prompts) -> dict:
        srv = self.busy[name]
        _post(srv.base_url, "/flush_cache")
        time.sleep(1.0)  # the original's pause after its flush
        for p in self.traces[name].values():
            self._new_lines(p)  # what came before this run is not its
        swift = name == "swiftcache"
        stats0 = _swift_stats(srv.base_url) if swift else {}
        work0 = read_work(srv.base_url, settle=True) if swift else None
        load_before = os.getloadavg()
        t0 = time.monotonic()
        turns = asyncio.run(drive(srv.base_url, load, prompts))
        wall = time.monotonic() - t0
        load_after = os.getloadavg()
        stats = {}
        if swift:
            s1 = _swift_stats(srv.base_url)
            stats = {k: s1.get(k, 0) - stats0.get(k, 0) for k in s1}
            stats["swiftcache_borrowed_tokens"] = s1.get("swiftcache_borrowed_tokens")
        work = breakdown(work0, read_work(srv.base_url, settle=True), len(turns),
                         "request") if swift else None
        fwd = [{"start": f["end_unix"] - f["wall_ms"] / 1e3, "end": f["end_unix"],
                "mode": f["mode"], "new_tokens": f["new_tokens"]}
               for f in self._new_lines(self.traces[name]["forward"]) if "end_unix" in f]
        extends = sorted((f for f in fwd if f["mode"] == "EXTEND"), key=lambda f: f["end"])
        loads = phases.load_index(self._new_lines(self.traces[name]["loads"]))
        rows = [asdict(t) for t in turns]
        for row in rows:
            row.pop("text")
            row["timeline"] = phases.timeline(row, extends, loads)
        return {"turns": rows, "wall_s": round(wall, 1), "stats": stats, "work": work,
                "loadavg": [round(x, 2) for x in (*load_before, *load_after)],
                "forwards": len(fwd)}


def run_summary(run: dict) -> dict:
    """TTFT figures, cached tokens and phase statistics of one run."""
    ttft = [t["ttft"] * 1e3 for t in run["turns"]]
    timelines = [t["timeline"] for t in run["turns"]]
    return {"requests": len(ttft), "ttft_avg_ms": sum(ttft) / len(ttft),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90),
            "ttft_p99_ms": pct(ttft, 99),
            "cached_tokens": sum(t["cached_tokens"] for t in run["turns"]),
            "prompt_tokens": sum(t["prompt_tokens"] for t in run["turns"]),
            "phases": phases.phase_stats(timelines),
            "tail": phases.tail_breakdown(timelines, ttft),
            "loadavg": run["loadavg"], "wall_s": run["wall_s"]}


def point(runs: dict[str, dict]) -> dict:
    """One client count and seed: the four runs' summaries and the ratios."""
    s = {name: run_summary(run) for name, run in runs.items()}
    st, sw, ide, tw = (s[n] for n in SYSTEMS)
    out = {"runs": s,
           "ttft_p99_vs_stock": sw["ttft_p99_ms"] / st["ttft_p99_ms"],
           "ttft_avg_vs_ideal": sw["ttft_avg_ms"] / ide["ttft_avg_ms"],
           "ttft_p99_vs_ideal": sw["ttft_p99_ms"] / ide["ttft_p99_ms"],
           "twin_ttft_avg_vs_ideal": tw["ttft_avg_ms"] / ide["ttft_avg_ms"],
           "twin_ttft_p99_vs_ideal": tw["ttft_p99_ms"] / ide["ttft_p99_ms"]}
    slow = phases.slowest_phase(sw["phases"])
    if slow is not None:
        slow["stock_p99_ms"] = (st["phases"].get(slow["phase"]) or {}).get("p99")
    out["slowest_phase_p99"] = slow
    out["phase_p99_excess_vs_stock"] = phases.largest_excess(sw["phases"], st["phases"])
    out["swift_stats"] = runs["swiftcache"]["stats"]
    out["swift_work_per_request"] = runs["swiftcache"]["work"]
    return out


def over_seeds(points: list[dict]) -> dict:
    """Means over the seeds, the worst seed (the largest ratio) and the spread (max - min)."""
    out: dict = {"seeds": len(points)}
    for key in RATIOS:
        vals = [p[key] for p in points]
        out[key] = {"mean": sum(vals) / len(vals), "worst": max(vals),
                    "spread": max(vals) - min(vals)}
    slow = [p["slowest_phase_p99"] for p in points if p["slowest_phase_p99"]]
    if slow:
        worst = max(slow, key=lambda x: x["p99_ms"])
        by: dict[str, list[float]] = {}
        for x in slow:
            by.setdefault(x["phase"], []).append(x["p99_ms"])
        name = max(by, key=lambda k: sum(by[k]) / len(points))
        out["slowest_phase_p99"] = {"mean": {"phase": name,
                                             "p99_ms": sum(by[name]) / len(by[name]),
                                             "seeds": len(by[name])},
                                    "worst": worst}
    excess = [p["phase_p99_excess_vs_stock"] for p in points if p["phase_p99_excess_vs_stock"]]
    if excess:
        out["phase_p99_excess_vs_stock"] = {"per_seed": [x["phase"] for x in excess],
                                            "worst": max(excess, key=lambda x: x["excess_ms"])}
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_multiturn.py", description=__doc__.splitlines()[0])
    d = Workload()
    ap.add_argument("--quick", action="store_true", help="8 and 16 clients, seeds 1 and 2")
    ap.add_argument("--clients", default=None, help="client counts (default 8,16,32)")
    ap.add_argument("--seeds", default=None, help="seeds (default 1,2,3)")
    ap.add_argument("--num-rounds", type=int, default=d.rounds)
    ap.add_argument("--request-length", type=int, default=d.request_length)
    ap.add_argument("--output-length", type=int, default=d.output_length)
    ap.add_argument("--max-parallel", type=int, default=d.max_parallel)
    ap.add_argument("--request-rate", type=float, default=d.request_rate)
    ap.add_argument("--distribution", default=d.distribution)
    ap.add_argument("--ready-queue-policy", default=d.ready_queue_policy)
    ap.add_argument("--busy-pool", type=int, default=1024)
    ap.add_argument("--donor-pool", type=int, default=16384)
    ap.add_argument("--lend-fraction", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=Path("runs/multiturn"))
    args = ap.parse_args(argv)
    args.client_counts = [int(x) for x in (args.clients or ("8,16" if args.quick else "8,16,32"))
                          .split(",") if x]
    args.seed_list = [int(x) for x in (args.seeds or ("1,2" if args.quick else "1,2,3"))
                      .split(",") if x]
    return args


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from ..tools.tiny_model import ensure_tiny_model

    args = parse(argv)
    started = time.monotonic()
    busy_model, donor_model = ensure_tiny_model(shape="small"), ensure_tiny_model(shape="tiny")
    busy, donor = ModelFacts.from_dir(busy_model), ModelFacts.from_dir(donor_model)
    plan = NodePlan(busy_pool=args.busy_pool, donor_pool=args.donor_pool,
                    lend_fraction=args.lend_fraction)
    loan, lent = plan.planned_loan(busy, donor)
    tok = AutoTokenizer.from_pretrained(str(busy_model))
    base = Workload(rounds=args.num_rounds, request_length=args.request_length,
                    output_length=args.output_length, max_parallel=args.max_parallel,
                    request_rate=args.request_rate, distribution=args.distribution,
                    ready_queue_policy=args.ready_queue_policy)
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(plan, busy_model, donor_model, args.out, loan, lent,
                  plan.lendable_busy_tokens(busy, donor))
    print(f"pools: busy {plan.busy_pool}, SwiftCache's loan {loan} busy tokens ({lent} donor "
          f"tokens), ideal {plan.busy_pool + loan}; load {asdict(base)}", flush=True)
    detail: dict = {}
    summary: dict = {}
    try:
        bench.start()
        turn = 0
        for n in args.client_counts:
            points = []
            for seed in args.seed_list:
                load = replace(base, clients=n, seed=seed)
                prompts = Prompts.build(load, tok.vocab_size, tok.num_special_tokens_to_add(),
                                        tok.decode)
                order = SYSTEMS[turn % 4:] + SYSTEMS[:turn % 4]
                turn += 1
                runs = {}
                for name in order:
                    runs[name] = bench.run(name, load, prompts)
                    r = run_summary(runs[name])
                    print(f"[{n} clients, seed {seed}] {name}: cached {r['cached_tokens']} of "
                          f"{r['prompt_tokens']}, TTFT avg {r['ttft_avg_ms']:.0f} ms, P90 "
                          f"{r['ttft_p90_ms']:.0f}, P99 {r['ttft_p99_ms']:.0f}; load "
                          f"{r['loadavg'][:3]} -> {r['loadavg'][3:]}", flush=True)
                p = point({k: runs[k] for k in SYSTEMS})
                p.update(clients=n, seed=seed, order=list(order))
                points.append(p)
                detail[f"{n}-{seed}"] = {"point": p, "runs": runs}
                (args.out / "multiturn.json").write_text(json.dumps(detail, indent=1))
                print(f"[{n} clients, seed {seed}] " + json.dumps(
                    {k: p[k] for k in (*RATIOS, "slowest_phase_p99",
                                       "phase_p99_excess_vs_stock")}), flush=True)
            summary[str(n)] = over_seeds(points)
    finally:
        bench.stop()
    summary.update(load=asdict(base), pools={"busy": plan.busy_pool, "loan": loan,
                                             "ideal": plan.busy_pool + loan},
                   wall_s=round(time.monotonic() - started), quick=args.quick,
                   device=f"CPU only ({os.cpu_count()} cores)")
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0
