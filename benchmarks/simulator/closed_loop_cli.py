"""`simulate --closed-loop`: clients, rounds, request and output lengths and max parallel, as
SGLang's bench_multiturn.py takes them, at multiples of HiCache's capacity (every figure
SIMULATED). The busy model's node is the paper's, with the first of `--host-gb` and
`--pcie-gbps`; donors idle. Per multiple and system: medians over `--seeds` of P99 TTFT and
cached tokens."""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from . import closed_loop as cl
from .scenario import PAPER

MULTIPLES = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
SYSTEMS = ("sglang-hicache", "swiftcache", "ideal")


def add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("closed loop (--closed-loop), as bench_multiturn.py")
    g.add_argument("--closed-loop", action="store_true",
                   help="fixed clients and rounds at multiples of HiCache's capacity")
    g.add_argument("--capacity-multiples", default=",".join(f"{m:g}" for m in MULTIPLES),
                   help="clients as multiples of HiCache's capacity (default %(default)s)")
    g.add_argument("--num-rounds", type=int, default=cl.ClosedLoop.rounds)
    g.add_argument("--request-length", type=int, default=cl.ClosedLoop.request_length,
                   help="new tokens per round (default %(default)s)")
    g.add_argument("--output-length", type=int, default=cl.ClosedLoop.output_length,
                   help="answer tokens per round (default %(default)s)")
    g.add_argument("--max-parallel", type=int, default=cl.ClosedLoop.max_parallel,
                   help="requests in flight at most (default %(default)s)")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s the sends are spaced at (default inf: unpaced)")
    g.add_argument("--ready-queue-policy", choices=("random", "fifo"), default="random")


def run(a: argparse.Namespace) -> dict:
    scn = replace(PAPER, host_bytes=a.host_gb[0] * 1e9, pcie_bw=a.pcie_gbps[0] * 1e9)
    multiples = tuple(float(x) for x in a.capacity_multiples.split(",") if x.strip())
    by_seed = []
    for seed in a.seeds:
        base = cl.ClosedLoop(1, a.num_rounds, a.request_length, a.output_length, a.max_parallel,
                             a.request_rate, a.ready_queue_policy, seed)
        by_seed.append(cl.sweep(scn, base, multiples, SYSTEMS))
    points = []
    for i, m in enumerate(multiples):
        runs = [s["points"][i] for s in by_seed]
        med = {sys: {k: float(np.median([r["systems"][sys][k] for r in runs]))
                     for k in ("ttft_p99", "cached_tokens")} for sys in SYSTEMS}
        h = med["sglang-hicache"]
        points.append({
            "multiple": m, "clients": runs[0]["clients"],
            "ttft_p99_s": {s: round(v["ttft_p99"], 3) for s, v in med.items()},
            "cached_tokens": {s: int(v["cached_tokens"]) for s, v in med.items()},
            "p99_ttft_reduction_vs_hicache": {s: round(1 - med[s]["ttft_p99"] / h["ttft_p99"], 4)
                                              for s in SYSTEMS[1:]},
            "cached_vs_hicache": {s: round(med[s]["cached_tokens"] / h["cached_tokens"], 4)
                                  for s in SYSTEMS[1:]},
            "hits_by_tier": {s: runs[0]["systems"][s]["hits_by_tier"] for s in SYSTEMS}})
    return {"capacity_clients": round(by_seed[0]["capacity_clients"], 2), "points": points,
            "params": {"rounds": a.num_rounds, "request_length": a.request_length,
                       "output_length": a.output_length, "max_parallel": a.max_parallel,
                       "request_rate": a.request_rate if math.isfinite(a.request_rate) else "inf",
                       "ready_queue_policy": a.ready_queue_policy, "seeds": list(a.seeds),
                       "host_gb": a.host_gb[0], "pcie_gbps": a.pcie_gbps[0]}}


def table_md(res: dict) -> str:
    lines = ["| x HiCache capacity | clients | P99 TTFT (s): HiCache / SwiftCache / ideal "
             "| cached tokens vs HiCache: SwiftCache / ideal | P99 TTFT reduction: SwiftCache "
             "/ ideal |", "|---|---|---|---|---|"]
    for p in res["points"]:
        t, c, r = p["ttft_p99_s"], p["cached_vs_hicache"], p["p99_ttft_reduction_vs_hicache"]
        ttft = " / ".join(f"{t[s]:.2f}" for s in SYSTEMS)
        lines.append(f"| {p['multiple']:g} | {p['clients']} | {ttft} "
                     f"| {c['swiftcache']:.3f} / {c['ideal']:.3f} "
                     f"| {r['swiftcache']:+.1%} / {r['ideal']:+.1%} |")
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    t0 = time.time()
    res = run(a)
    out = Path(a.out or "runs/sim-closed-loop")
    out.mkdir(parents=True, exist_ok=True)
    (out / "closed_loop.json").write_text(json.dumps(res, indent=1))
    print("All numbers below are SIMULATED (medians over the seeds).\n")
    print(f"HiCache's capacity: {res['capacity_clients']} clients of "
          f"{a.num_rounds} x ({a.request_length} + {a.output_length}) tokens\n")
    print(table_md(res))
    print(f"\nwall {time.time() - t0:.0f} s")
    print(json.dumps({"simulated": True, "mode": "closed_loop", **res}))
    return 0
