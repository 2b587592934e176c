"""The sweeps behind docs/simulation.md. Every number they produce is SIMULATED."""

from __future__ import annotations

from dataclasses import asdict, replace

from .capacity import max_context
from .scenario import SYSTEMS, Scenario, run_point


def load_sweep(scn: Scenario, rates, window: float, systems=tuple(SYSTEMS), seed: int = 0,
               progress=None) -> list[dict]:
    out = []
    for rate in rates:
        for system in systems:
            r = run_point(scn, system, rate, window, seed=seed, with_donors=(system == "swiftcache"))
            out.append(asdict(r))
            if progress:
                progress(f"{scn.name} {scn.workload} {system} @ {rate}/s: P99 TTFT {r.master['ttft_p99']:.3f} s")
    return out


def donors_alone(scn: Scenario, window: float, seed: int = 0, donor_rate: float | None = None) -> dict:
    """Donor metrics without lending (no SwiftCache): the reference for interference."""
    r = run_point(scn, "sglang-hicache", 0.0, window, seed=seed, with_master=False, with_donors=True,
                  lend=False, donor_rate=donor_rate)
    return r.donors


def interference(sweep: list[dict], alone: dict) -> list[dict]:
    """Per master rate and donor: relative change of donor P99 TTFT and P99 TPOT with lending."""
    rows = []
    for run in sweep:
        if run["system"] != "swiftcache":
            continue
        for name, lend in run["donors"].items():
            base = alone.get(name)
            if not base or not base["ttft_p99"] or not lend["ttft_p99"]:
                continue
            rows.append({
                "rate": run["rate"], "donor": name,
                "ttft_p99_alone": base["ttft_p99"], "ttft_p99_lending": lend["ttft_p99"],
                "tpot_p99_alone": base["tpot_p99"], "tpot_p99_lending": lend["tpot_p99"],
                "ttft_change": lend["ttft_p99"] / base["ttft_p99"] - 1.0,
                "tpot_change": (lend["tpot_p99"] / base["tpot_p99"] - 1.0) if base["tpot_p99"] else 0.0,
            })
    return rows


def reductions(sweep: list[dict], base: str = "sglang-hicache", ours: str = "swiftcache") -> list[dict]:
    by = {(r["system"], r["rate"]): r["master"] for r in sweep}
    rows = []
    for rate in sorted({r["rate"] for r in sweep}):
        b, o = by.get((base, rate)), by.get((ours, rate))
        if b and o and b["ttft_p99"]:
            rows.append({"rate": rate, "base_p99": b["ttft_p99"], "ours_p99": o["ttft_p99"],
                         "reduction": 1.0 - o["ttft_p99"] / b["ttft_p99"],
                         "stable_base": b["stable"], "stable_ours": o["stable"]})
    return rows


def donors_busy(scn: Scenario, master_rate: float, donor_rates, window: float, seed: int = 0,
                progress=None) -> list[dict]:
    """SwiftCache vs HiCache as the donors get busier (they reclaim what they lent)."""
    rows = []
    for dr in donor_rates:
        s = replace(scn, donor_rate=dr)
        h = run_point(s, "sglang-hicache", master_rate, window, seed=seed, with_donors=False)
        w = run_point(s, "swiftcache", master_rate, window, seed=seed)
        alone = donors_alone(s, window, seed)
        worst = 0.0
        for name, lend in w.donors.items():
            a = alone.get(name)
            if a and a["ttft_p99"] and lend["ttft_p99"]:
                worst = max(worst, lend["ttft_p99"] / a["ttft_p99"] - 1.0,
                            (lend["tpot_p99"] / a["tpot_p99"] - 1.0) if a["tpot_p99"] else 0.0)
        rows.append({"donor_rate": dr, "hicache_p99": h.master["ttft_p99"], "swift_p99": w.master["ttft_p99"],
                     "reduction": 1.0 - w.master["ttft_p99"] / h.master["ttft_p99"],
                     "lent_blocks": w.lent_blocks, "reclaimed_blocks": w.reclaimed_blocks,
                     "donor_hit": w.master["hit_rate"].get("donor", 0.0),
                     "load_failures": w.master["load_failures"], "donor_interference": worst})
        if progress:
            progress(f"donors busy {dr}/s: reduction {rows[-1]['reduction']:.2f}, reclaimed {w.reclaimed_blocks}")
    return rows


def capacity_table(scn: Scenario, fractions=(0.25, 0.5, 0.75)) -> dict:
    return {"default": max_context(scn), "sensitivity": [max_context(scn, f) for f in fractions]}
