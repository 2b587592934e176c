"""`simulate`: the node-scale simulator's experiments; prints tables and, last, a JSON summary.

Every figure it produces is SIMULATED (see docs/simulation.md for the model and its sources).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from . import experiments as ex
from . import report
from .scenario import PAPER, SCENARIOS

QUICK = dict(rates=(0.5, 1.0, 1.5, 2.0), window=300.0)
FULL_RATES = {
    ("paper-4xH20", "chat"): (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0),
    ("paper-4xH20", "agent"): (0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2),
    ("paper-4xH20", "single"): (0.25, 0.5, 1.0, 1.5),
    ("8xH100", "chat"): (1.0, 2.0, 4.0, 6.0, 8.0, 12.0),
    ("8xH200", "chat"): (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="simulate", description=__doc__)
    p.add_argument("--quick", action="store_true", help="paper setup only, 4 rates, 300 s window (< 1 min)")
    p.add_argument("--window", type=float, default=600.0, help="seconds of session arrivals per point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default runs/sim-<time>)")
    return p


def _say(msg: str) -> None:
    print(f"[simulated] {msg}", file=sys.stderr, flush=True)


def run(a: argparse.Namespace, out: Path) -> dict:
    res: dict = {"simulated": True, "quick": a.quick, "seed": a.seed}
    md: list[str] = ["All numbers below are SIMULATED.\n"]
    window = QUICK["window"] if a.quick else a.window
    plan = [(PAPER, "chat")] if a.quick else [
        (PAPER, "chat"), (PAPER, "agent"), (PAPER, "single"),
        (SCENARIOS["8xH100"], "chat"), (SCENARIOS["8xH200"], "chat")]
    for scn, wl in plan:
        s = replace(scn, workload=wl)
        rates = QUICK["rates"] if a.quick else FULL_RATES[(scn.name, wl)]
        sweep = ex.load_sweep(s, rates, window, seed=a.seed, progress=_say)
        alone = ex.donors_alone(s, window, seed=a.seed)
        inter = ex.interference(sweep, alone)
        red = ex.reductions(sweep)
        key = f"{scn.name}/{wl}"
        png = report.sweep_plot(sweep, out / f"p99_ttft_vs_rate_{scn.name}_{wl}.png",
                                f"P99 TTFT vs rate, {scn.name}, {scn.master}, {wl}")
        res[key] = {"sweep": sweep, "reductions": red, "interference": inter, "donors_alone": alone,
                    "plot": str(png)}
        md += [f"## {key}: P99 TTFT of {scn.master} (SIMULATED)\n", report.sweep_table(sweep), "",
               report.reduction_table(red), "", f"plot: {png}\n",
               f"### {key}: donor interference (SIMULATED)\n", report.interference_table(inter), ""]
    for scn in ([PAPER] if a.quick else [PAPER, SCENARIOS["8xH100"], SCENARIOS["8xH200"]]):
        cap = ex.capacity_table(scn)
        res[f"{scn.name}/capacity"] = cap
        md += [f"## {scn.name}: maximum context of {scn.master} (SIMULATED)\n", report.capacity_md(cap), ""]
    if not a.quick:
        busy = ex.donors_busy(PAPER, 1.0, (0.05, 0.2, 0.5, 1.0, 2.0), window, seed=a.seed, progress=_say)
        res["paper-4xH20/donors_busy"] = busy
        md += ["## paper-4xH20/chat at 1.0 session/s: donors getting busy (SIMULATED)\n", report.busy_table(busy), ""]
    md += ["## Parameters\n", report.assumptions_md()]
    (out / "tables.md").write_text("\n".join(md) + "\n")
    res["tables_md"] = str(out / "tables.md")
    return res


def summary(res: dict) -> dict:
    red = res["paper-4xH20/chat"]["reductions"]
    best = max(red, key=lambda r: r["reduction"])
    stable = [r for r in red if r["stable_base"] and r["stable_ours"]]
    best_stable = max(stable, key=lambda r: r["reduction"]) if stable else None
    inter = res["paper-4xH20/chat"]["interference"]
    worst = max([max(r["ttft_change"], r["tpot_change"]) for r in inter], default=0.0)
    return {
        "simulated": True,
        "scenario": "paper-4xH20 (4x H20, Qwen3-32B + Qwen3-14B/8B/4B donors), ShareGPT multi-turn",
        "p99_ttft_reduction_vs_hicache": round(max(0.0, best["reduction"]), 4),
        "at_rate": best["rate"],
        "p99_ttft_reduction_vs_hicache_stable_only": (round(max(0.0, best_stable["reduction"]), 4)
                                                     if best_stable else None),
        "max_context_ratio": round(res["paper-4xH20/capacity"]["default"]["ratio"], 3),
        "donor_interference": round(min(1.0, max(0.0, worst)), 4),
    }


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    out = Path(a.out or f"runs/sim-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res = run(a, out)
    s = summary(res)
    res["summary"] = s
    res["wall_s"] = time.time() - t0
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    print(Path(res["tables_md"]).read_text())
    print(f"results: {out / 'results.json'}  (wall {res['wall_s']:.0f} s)")
    print(json.dumps(s))
    return 0
