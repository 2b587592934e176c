"""`simulate`: the node-scale simulator's experiments; prints tables and, last, a JSON summary.

Every figure it produces is SIMULATED (see docs/simulation.md for the model and its sources).
The summary's headline figures, for the paper setup's ShareGPT chat, each given twice (against
HiCache as the paper ran it, and against HiCache with as much cache memory as SwiftCache):
  goodput_ratio_vs_hicache      SwiftCache's goodput / HiCache's (highest session rate with P99
                                TTFT under the SLO and a queue that does not grow; goodput.py)
  p99_ttft_reduction_at_stable  1 - SwiftCache's P99 TTFT / HiCache's, both at the highest rate
                                HiCache sustains
with the memory each system has per tier beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from . import closed_loop_cli, regime_cli, report
from . import experiments as ex
from . import goodput as gp
from .scenario import SCENARIOS

HEADLINE_SHARE = 0.5  # donors serve half of their own goodput (docs/simulation.md section 2)
QUICK = dict(rates=(0.25, 0.5, 0.75, 1.0, 1.5), window=600.0, refine_steps=4, donor_refine_steps=2,
             shares=(0.25, 0.5, 0.75), slo_factors=(gp.SLO_FACTOR,))
FULL = dict(refine_steps=5, donor_refine_steps=3, shares=(0.25, 0.5, 0.75, 0.9),
            slo_factors=(2.0, gp.SLO_FACTOR, 10.0))
FULL_RATES = {
    "paper-4xH20/chat": (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0),
    "paper-4xH20/agent": (0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2),
    "paper-4xH20/single": (0.25, 0.5, 1.0, 1.5, 2.0, 3.0),
    "8xH100/chat": (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0),
    "8xH200/chat": (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0),
}
HEADLINE = "paper-4xH20/chat"
CAPACITY_REFINE_STEPS = 3  # the --quick capacity cell's goodput bisections (as the grid's)
# The 8-GPU nodes are opt-in: seven donors at half their own goodput serve ~100 chat sessions/s,
# which takes this event simulator hours per sweep on two CPU cores.
FULL_DEFAULT = ("paper-4xH20/chat", "paper-4xH20/agent", "paper-4xH20/single")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="paper setup, chat only (a few minutes)")
    p.add_argument("--window", type=float, default=600.0,
                   help="seconds of session arrivals per point")
    p.add_argument("--scenarios", default=",".join(FULL_DEFAULT),
                   help=f"full run: comma-separated scenario/workload keys, {HEADLINE} first "
                        f"(choices: {', '.join(FULL_RATES)}; the 8-GPU ones take hours)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-context", action="store_true",
                   help="the paper's long-context scenario (LWM-Text-1M on an H20 with three "
                        "donors): maximum context and per-token slowdown from the stepwise "
                        "streaming model (seconds)")
    p.add_argument("--validate", action="store_true",
                   help="simulate this CPU node (bench_node's servers, models and traffic) with "
                        "the parameters of scripts/calibrate_cpu.py and print it beside "
                        "bench_node's live records; last line a JSON object with ttft_p50_error "
                        "and cached_tokens_error")
    p.add_argument("--calibration", type=Path, default=Path("runs/calibration/cpu.json"),
                   help="--validate: the JSON scripts/calibrate_cpu.py wrote")
    p.add_argument("--live", type=Path, default=Path("runs/node_bench/node_bench.json"),
                   help="--validate: bench_node's saved records (its --out directory's "
                        "node_bench.json)")
    p.add_argument("--demote-ahead", type=float, default=0.0,
                   help="--validate: the pool fraction the live borrower kept free by demoting "
                        "ahead (0 since commit 0be01c3, 0.125 before it): which code the live run "
                        "ran")
    p.add_argument("--tiers", action="store_true",
                   help="--validate: bench_tiers' runs instead (stock, HiCache, HiCache + "
                        "SwiftCache, the upper bound) against its records, with the "
                        "calibration of scripts/calibrate_cpu.py --bench tiers")
    p.add_argument("--calibration-tiers", type=Path,
                   default=Path("runs/calibration/cpu_tiers.json"),
                   help="--validate --tiers: the JSON scripts/calibrate_cpu.py --bench tiers wrote")
    p.add_argument("--live-tiers", type=Path, default=Path("runs/bench_tiers/records.json"),
                   help="--validate --tiers: bench_tiers' records (its --out directory's "
                        "records.json, a run without --l3)")
    p.add_argument("--out", default=None, help="output directory (default runs/sim-<time>)")
    p.add_argument("--long-context-sweep", action="store_true",
                   help="the long-context model swept: lend fraction x host memory x resident "
                        "fraction x backing (the live host-backed store, and donor + host "
                        "additive), idle donors; seconds")
    regime_cli.add_options(p)
    closed_loop_cli.add_options(p)
    return p


_T0 = 0.0  # set by main(): progress lines show seconds since the run began


def _say(msg: str) -> None:
    print(f"[simulated {time.monotonic() - _T0:5.0f} s] {msg}", file=sys.stderr, flush=True)


def evaluate(scn, rates, window, seed, plan, donor_goodput) -> dict:
    """One scenario and master workload: sweep, goodput comparisons, SLO sensitivity,
    interference."""
    points = ex.Points(scn, window, seed, progress=_say)
    sweep = ex.load_sweep(points, rates)
    found = {f: ex.goodputs(points, rates, gp.master_slo_s(scn, seed, f), plan["refine_steps"])
             for f in plan["slo_factors"]}
    comparisons = {name: ex.compare(points, found[gp.SLO_FACTOR], base)
                   for name, base in ex.COMPARISONS.items()}
    for name, base in ex.COMPARISONS.items():
        comparisons[name]["goodput_ratio_vs_hicache_by_slo_factor"] = {
            str(f): (round(g[ex.OURS].rate / g[base].rate, 4) if g[base].rate > 0 else None)
            for f, g in found.items()}
    # the donors are measured while SwiftCache serves the most it sustains (the lowest swept rate
    # when it sustains none)
    master_rate = found[gp.SLO_FACTOR][ex.OURS].rate or min(rates)
    inter = ex.interference_by_share(scn, donor_goodput, plan["shares"], master_rate, window, seed,
                                     progress=_say)
    return {"sweep": sweep, "reductions": ex.reductions(sweep),
            "reductions_equal_memory": ex.reductions(sweep, base="sglang-hicache-bighost"),
            "goodput": {str(f): {s: asdict(g) for s, g in by.items()} for f, by in found.items()},
            "comparisons": comparisons, "interference": inter}


def _plan_keys(a: argparse.Namespace) -> list[str]:
    keys = [HEADLINE] if a.quick else [k.strip() for k in a.scenarios.split(",") if k.strip()]
    unknown = [k for k in keys if k not in FULL_RATES]
    if unknown or not keys or keys[0] != HEADLINE:
        raise SystemExit(f"--scenarios: give {HEADLINE} first (the summary reports it), then any "
                         f"of {', '.join(FULL_RATES)}; got {a.scenarios!r}")
    return keys


def _write(res: dict, md: list[str], out: Path) -> None:
    """Tables and results so far: a long run that stops early keeps what it finished."""
    tail = ["## Parameters\n", report.assumptions_md()]
    (out / "tables.md").write_text("\n".join(md + tail) + "\n")
    res["tables_md"] = str(out / "tables.md")
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))


def run(a: argparse.Namespace, out: Path) -> dict:
    plan = dict(QUICK) if a.quick else dict(FULL, window=a.window)
    window = plan["window"]
    res: dict = {"simulated": True, "quick": a.quick, "seed": a.seed, "window_s": window,
                 "donor_load_share": HEADLINE_SHARE, "donor_goodput": {}}
    md: list[str] = ["All numbers below are SIMULATED.\n"]
    keys = _plan_keys(a)
    for key in keys:
        name, wl = key.split("/")
        scn = SCENARIOS[name]
        if scn.name not in res["donor_goodput"]:
            cap = ex.capacity_table(scn)
            res[f"{scn.name}/capacity"] = cap
            md += [f"## {scn.name}: maximum context of {scn.master} (SIMULATED)\n",
                   report.capacity_md(cap), ""]
            caps, slos = gp.donor_goodputs(scn, window, a.seed,
                                           refine_steps=plan["donor_refine_steps"], progress=_say)
            res["donor_goodput"][scn.name] = {"sessions_per_s": caps, "slo_p99_ttft_s": slos}
            md += [f"## {scn.name}: donors' own goodput, alone (SIMULATED)\n",
                   report.donor_goodput_table(scn, caps, slos), ""]
        caps = res["donor_goodput"][scn.name]["sessions_per_s"]
        s = replace(scn, workload=wl, donor_rates=ex.donor_rates(caps, HEADLINE_SHARE))
        rates = plan["rates"] if a.quick else FULL_RATES[key]
        ev = evaluate(s, rates, window, a.seed, plan, caps)
        png = report.sweep_plot(ev["sweep"], out / f"p99_ttft_vs_rate_{scn.name}_{wl}.png",
                                f"P99 TTFT vs rate, {scn.name}, {scn.master}, {wl}")
        res[key] = dict(ev, plot=str(png))
        md += [f"## {key}: goodput and P99 TTFT of {scn.master} (SIMULATED)\n",
               report.comparison_table(ev["comparisons"]), "",
               report.sweep_table(ev["sweep"]), "", "Against HiCache as the paper ran it:\n",
               report.reduction_table(ev["reductions"]), "",
               "Against HiCache with SwiftCache's cache memory (equal fast memory):\n",
               report.reduction_table(ev["reductions_equal_memory"]), "", f"plot: {png}\n",
               f"### {key}: donor interference (SIMULATED)\n",
               report.interference_table(ev["interference"]), ""]
        _write(res, md, out)
    if a.quick:  # the capacity-bound cell chosen in docs/simulation.md section 9, one seed
        cap = regime_cli.capacity_regime(window, a.seed, CAPACITY_REFINE_STEPS, _say)
        res["capacity_regime"] = cap
        md += ["## Capacity regime: the realistic cell (SIMULATED, idle donors)\n",
               "```", json.dumps(cap, indent=1), "```", ""]
        _write(res, md, out)
    return res


def summary(res: dict) -> dict:
    """The last line: headline figures of the paper setup's chat, each labeled by what it
    measures."""
    ev = res[HEADLINE]
    inter = {str(r["share"]): round(r["worst_change"], 4) for r in ev["interference"]}

    def worst(metric):  # per share: the largest relative increase of that donor P99 over the donors
        return {str(r["share"]): round(max(d[f"{metric}_change"] for d in r["donors"]), 4)
                for r in ev["interference"]}

    return {
        "simulated": True,
        "scenario": "paper-4xH20 (4x H20, Qwen3-32B + Qwen3-14B/8B/4B donors), ShareGPT multi-turn",
        "slo": f"P99 TTFT <= {gp.SLO_FACTOR:g} x the P99 of the unloaded TTFT "
               f"({ev['comparisons']['paper_setup']['slo_p99_ttft_s']} s here); sustained = "
               f"within it and the waiting queue not growing",
        "comparisons": ev["comparisons"],
        "max_context_ratio": round(res["paper-4xH20/capacity"]["default"]["ratio"], 3),
        "donor_load_share_of_own_goodput": res["donor_load_share"],
        "donor_interference": inter.get(str(res["donor_load_share"])),
        "donor_interference_by_load_share": inter,
        "donor_p99_ttft_change_by_load_share": worst("ttft"),
        "donor_p99_tpot_change_by_load_share": worst("tpot"),
        "donor_interference_master_rate": (ev["interference"][0]["master_rate"]
                                           if ev["interference"] else None),
        **({"capacity_regime": res["capacity_regime"]} if "capacity_regime" in res else {}),
    }


def _long_context(a: argparse.Namespace) -> int:
    from . import long_context as lc

    rep = lc.scenario_report()
    out = Path(a.out or "runs/sim-long-context")
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_context.json").write_text(json.dumps(rep, indent=1, default=str))
    print("All numbers below are SIMULATED.\n")
    print(lc.report_md(rep))
    m = rep["main"]
    print(json.dumps({"simulated": True, "scenario": m["setup"], "model": m["model"],
                      "gpu": m["gpu"], "max_context_tokens": m["max_tokens"],
                      "max_context_ratio": round(m["ratio"], 3),
                      "decode_slowdown_at_max": round(m["at_max"]["decode_slowdown"], 2),
                      "prefill_slowdown_at_max": round(m["at_max"]["prefill_slowdown"], 4),
                      "decode_slowdown_at_baseline_max":
                          round(m["at_baseline_max"]["decode_slowdown"], 2),
                      "depth": m["depth"]}))
    return 0


def _long_context_sweep(a: argparse.Namespace) -> int:
    from . import long_context as lc

    rep = lc.sweep_report()
    out = Path(a.out or "runs/sim-long-context-sweep")
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_context_sweep.json").write_text(json.dumps(rep, indent=1))
    print("All numbers below are SIMULATED.\n")
    print(lc.sweep_md(rep))
    print(json.dumps({"simulated": True, "mode": "long_context_sweep", **rep}))
    return 0


def _validate(a: argparse.Namespace) -> int:
    if a.tiers:
        from . import validate_tiers as val

        args = (a.calibration_tiers, a.live_tiers)
    else:
        from . import validate as val

        args = (a.calibration, a.live, a.demote_ahead)
    try:
        res = val.validate(*args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"simulate --validate: {exc}", file=sys.stderr)
        return 2
    out = Path(a.out or "runs/sim-validate")
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate.json").write_text(json.dumps(res, indent=1, default=str))
    print(val.format_tables(res))
    print(f"every request side by side: {out / 'validate.json'}")
    print(json.dumps(val.summary_line(res)))
    return 0


def main(argv: list[str] | None = None) -> int:
    global _T0
    _T0 = time.monotonic()
    a = build_parser().parse_args(argv)
    if a.validate:
        return _validate(a)
    if a.long_context:
        return _long_context(a)
    if a.grid:
        return regime_cli.main(a, _say)
    if a.closed_loop:
        return closed_loop_cli.main(a)
    if a.long_context_sweep:
        return _long_context_sweep(a)
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
