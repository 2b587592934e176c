"""`simulate --grid`: the regime grid's options, its run and its report (every figure SIMULATED).

Every knob of a cell is an option (a comma-separated list each); the grid is their product, run
for every seed. The last line is one JSON object: per cell, each headline figure's median, min and
max over the seeds (regime.reduce_seeds).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path

from . import regime as rg


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("regime grid (--grid) and the --quick capacity cell")
    j = ",".join
    g.add_argument("--grid", action="store_true",
                   help="the regime grid: HiCache, HiCache + SwiftCache and the ideal per cell")
    g.add_argument("--workloads", type=_words, default=rg.GRID["workload"],
                   help=f"chat and/or agent (default {j(rg.GRID['workload'])})")
    g.add_argument("--think-s", type=_floats, default=rg.GRID["think_s"],
                   help="mean think time (chat) or tool time (agent), s (default "
                        f"{j(f'{x:g}' for x in rg.GRID['think_s'])})")
    g.add_argument("--min-turns", type=_ints, default=rg.GRID["min_turns"],
                   help="minimum turns per chat conversation (default "
                        f"{j(str(x) for x in rg.GRID['min_turns'])})")
    g.add_argument("--host-gb", type=_floats, default=rg.GRID["host_gb"],
                   help="HiCache's host memory for the busy model, GB (default "
                        f"{j(f'{x:g}' for x in rg.GRID['host_gb'])})")
    g.add_argument("--pcie-gbps", type=_floats, default=rg.GRID["pcie_gbps"],
                   help="effective PCIe bandwidth per direction, GB/s (default "
                        f"{j(f'{x:g}' for x in rg.GRID['pcie_gbps'])})")
    g.add_argument("--seeds", type=_ints, default=(0, 1, 2), help="traffic seeds (default 0,1,2)")
    g.add_argument("--refine-steps", type=int, default=3,
                   help="bisections of each goodput after its bracket (default 3)")
    g.add_argument("--write-policy", choices=("write_back", "write_through"),
                   default="write_back",
                   help="--hicache-write-policy of every system with a host tier (default "
                        "write_back: the tiers hold different prefixes)")
    g.add_argument("--workers", type=int, default=1,
                   help="processes running cells at once (default 1)")


def _task(job):
    cell, seed, window, refine, write_through = job
    return rg.evaluate(cell, seed, window, refine, write_through=write_through)


def run(a: argparse.Namespace, say) -> dict:
    """Every (cell, seed) of the grid the options name; returns the per-cell reductions."""
    grid = rg.cells(a.workloads, a.think_s, a.min_turns, a.host_gb, a.pcie_gbps)
    wt = a.write_policy == "write_through"
    jobs = [(c, s, a.window, a.refine_steps, wt) for c in grid for s in a.seeds]
    rows: dict[str, list] = {}
    t0 = time.monotonic()
    pool = mp.get_context("fork").Pool(a.workers) if a.workers > 1 else None
    results = pool.imap_unordered(_task, jobs) if pool else map(_task, jobs)
    for n, r in enumerate(results, 1):
        rows.setdefault(r["cell"], []).append(r)
        say(f"grid {n}/{len(jobs)} {r['cell']} seed {r['seed']}: goodput "
            f"{', '.join(f'{k} {v:.3g}' for k, v in r['goodput'].items())} "
            f"({r['runs']} runs, {time.monotonic() - t0:.0f} s)")
    if pool:
        pool.close()
    cells = {c.key: rg.reduce_seeds(sorted(rows[c.key], key=lambda r: r["seed"])) for c in grid}
    return {"rows": rows, "cells": cells}


def _fmt(stat) -> str:
    if stat is None:
        return "-"
    if stat["min"] == stat["max"]:
        return f"{stat['median']:.3g}"
    return f"{stat['median']:.3g} [{stat['min']:.3g}, {stat['max']:.3g}]"


def table_md(cells: dict) -> str:
    """One line per cell: medians over seeds [min, max]."""
    head = ("| cell | HiCache goodput (sessions/s) | goodput / HiCache | ideal / HiCache "
            "| P99 TTFT reduction at 50% / 80% / 95% of HiCache's goodput | hits at 80% "
            "(HiCache; SwiftCache) | peak live KV / device + host | device + host / all tiers "
            "(GB) |")
    lines = [head, "|" + "---|" * 8]
    for key, c in cells.items():
        red = " / ".join(_fmt(c[f"p99_ttft_reduction_at_{p}pct"]) for p in (50, 80, 95))
        hits = "; ".join(", ".join(f"{t} {v:.2f}" for t, v in c["hits_by_tier_at_80pct"][s].items())
                         for s in (rg.HICACHE, rg.OURS))
        lines.append(f"| {key} | {_fmt(c['hicache_goodput'])} | "
                     f"{_fmt(c['goodput_ratio_vs_hicache'])} | "
                     f"{_fmt(c['ideal_goodput_ratio_vs_hicache'])} | {red} | {hits} | "
                     f"{c['peak_live_over_device_plus_host']} | {c['device_plus_host_gb']} / "
                     f"{c['all_tiers_gb']} |")
    return "\n".join(lines)


def main(a: argparse.Namespace, say) -> int:
    out = Path(a.out or f"runs/sim-grid-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res = run(a, say)
    (out / "grid.json").write_text(json.dumps(res, indent=1, default=str))
    print("All numbers below are SIMULATED (medians over the seeds, [min, max]).\n")
    print(table_md(res["cells"]))
    print(f"\nevery run: {out / 'grid.json'}  (wall {time.time() - t0:.0f} s)")
    realistic = rg.REALISTIC.key
    print(json.dumps({"simulated": True, "mode": "grid", "seeds": list(a.seeds),
                      "window_s": a.window, "refine_steps": a.refine_steps,
                      "write_policy": a.write_policy, "donors": "idle (the lease whole)",
                      "realistic_cell": realistic if realistic in res["cells"] else None,
                      "cells": res["cells"]}))
    return 0


def capacity_regime(window: float, seed: int, refine_steps: int, say=None) -> dict:
    """`--quick`'s capacity figure: the cell docs/simulation.md section 9 argues is realistic for
    the paper's node (chosen before the grid ran), one seed."""
    r = rg.evaluate(rg.REALISTIC, seed, window, refine_steps, say)
    red = rg.reduce_seeds([r])
    return {"cell": rg.REALISTIC.key, "seed": seed,
            "goodput_ratio_vs_hicache": (red["goodput_ratio_vs_hicache"] or {}).get("median"),
            "p99_ttft_reduction_at_80pct": (red["p99_ttft_reduction_at_80pct"] or {}).get(
                "median"),
            "goodput_sessions_per_s": {k: round(v, 4) for k, v in r["goodput"].items()},
            "hits_by_tier_at_80pct": red["hits_by_tier_at_80pct"],
            "peak_live_over_device_plus_host": red["peak_live_over_device_plus_host"]}
