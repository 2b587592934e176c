"""The experiments behind docs/simulation.md: sweeps, goodput comparisons, donor interference.
Every number they produce is SIMULATED.

Two comparisons of SwiftCache against HiCache, each at equal traffic and the same SLO:
  paper_setup        HiCache's host tier = hicache_ratio x device (the paper's baseline); SwiftCache
                     has that host tier plus the donor lease, so it has more memory in all
  equal_fast_memory  HiCache's host tier = SwiftCache's donor + host tiers together, so only where
                     the cache sits (donor HBM over NVLink vs host over PCIe) differs
"""

from __future__ import annotations

from dataclasses import asdict

from . import goodput as gp
from .long_context import LongContext, max_context
from .scenario import SYSTEMS, RunResult, Scenario, donor_name, master_memory_bytes, run_point

OURS = "swiftcache"
COMPARISONS = {"paper_setup": "sglang-hicache", "equal_fast_memory": "sglang-hicache-bighost"}
GOODPUT_SYSTEMS = (OURS, *COMPARISONS.values())  # what goodputs() searches by default


class Points:
    """The runs of one scenario by (system, master rate), each simulated once, when first asked for.
    SwiftCache runs carry the donors' own traffic (scn.donor_rates); the others need no donors."""

    def __init__(self, scn: Scenario, window: float, seed: int = 0, progress=None) -> None:
        self.scn, self.window, self.seed, self.progress = scn, window, seed, progress
        self.runs: dict[tuple[str, float], RunResult] = {}

    def get(self, system: str, rate: float) -> RunResult:
        key = (system, round(rate, 9))
        if key not in self.runs:
            r = run_point(self.scn, system, rate, self.window, seed=self.seed,
                          with_donors=(system == OURS))
            self.runs[key] = r
            if self.progress:
                self.progress(f"{self.scn.name} {self.scn.workload} {system} @ {rate:.4g}/s: "
                              f"P99 TTFT {r.master['ttft_p99']:.3f} s, stable {r.master['stable']}")
        return self.runs[key]

    def master(self, system: str, rate: float) -> dict:
        return self.get(system, rate).master


def load_sweep(points: Points, rates,
               systems=tuple(s for s in SYSTEMS if s != "ideal")) -> list[dict]:
    """Every system at every rate (the P99-vs-rate table and plot)."""
    return [asdict(points.get(system, rate)) for rate in rates for system in systems]


def goodputs(points: Points, rates, slo_s: float, refine_steps: int,
             systems=GOODPUT_SYSTEMS) -> dict[str, gp.Goodput]:
    return {s: gp.goodput(lambda r, s=s: points.master(s, r), rates, slo_s, refine_steps)
            for s in systems}


def _gb(nbytes: dict) -> dict:
    return {tier: round(v / 1e9, 2) for tier, v in nbytes.items()}


def compare(points: Points, found: dict[str, gp.Goodput], baseline: str) -> dict:
    """SwiftCache against `baseline`: goodput ratio, and the P99 TTFT reduction at the highest rate
    the baseline sustains (both systems run at that same rate)."""
    ours, base = found[OURS], found[baseline]
    stable_rate = base.rate
    p_base = points.master(baseline, stable_rate)["ttft_p99"] if stable_rate > 0 else None
    p_ours = points.master(OURS, stable_rate)["ttft_p99"] if stable_rate > 0 else None
    return {
        "baseline": baseline,
        "memory_gb": {OURS: _gb(master_memory_bytes(points.scn, OURS)),
                      baseline: _gb(master_memory_bytes(points.scn, baseline))},
        "slo_p99_ttft_s": round(base.slo_s, 3),
        "goodput_sessions_per_s": {OURS: round(ours.rate, 4), baseline: round(base.rate, 4)},
        "goodput_is_lower_bound": {OURS: ours.lower_bound, baseline: base.lower_bound},
        "goodput_ratio_vs_hicache": round(ours.rate / base.rate, 4) if base.rate > 0 else None,
        "stable_rate_sessions_per_s": round(stable_rate, 4),
        "p99_ttft_s_at_stable_rate": {OURS: p_ours, baseline: p_base},
        "p99_ttft_reduction_at_stable": round(1.0 - p_ours / p_base, 4) if p_base else None,
    }


def donor_rates(goodput_rates, share: float) -> tuple[float, ...]:
    """Each donor's own traffic at `share` of its goodput (sessions/s)."""
    return tuple(share * g for g in goodput_rates)


def interference_by_share(scn: Scenario, donor_goodput, shares, master_rate: float, window: float,
                          seed: int = 0, progress=None) -> list[dict]:
    """For each share: every donor serves `share` of its own goodput, alone and then while lending
    to SwiftCache's master at `master_rate`; the change of each donor's P99 TTFT and P99 TPOT."""
    out = []
    for share in shares:
        rates = donor_rates(donor_goodput, share)
        alone = run_point(scn, "sglang-radix", 0.0, window, seed=seed, with_master=False,
                          lend=False, donor_rates=rates).donors
        lending = run_point(scn, OURS, master_rate, window, seed=seed, donor_rates=rates)
        rows = []
        for i in range(len(scn.donors)):
            name = donor_name(scn, i)
            a, w = alone[name], lending.donors[name]
            rows.append({"donor": name, "rate": rates[i],
                         "ttft_p99_alone": a["ttft_p99"], "ttft_p99_lending": w["ttft_p99"],
                         "tpot_p99_alone": a["tpot_p99"], "tpot_p99_lending": w["tpot_p99"],
                         "ttft_change": w["ttft_p99"] / a["ttft_p99"] - 1.0,
                         "tpot_change": w["tpot_p99"] / a["tpot_p99"] - 1.0})
        worst = max(max(r["ttft_change"], r["tpot_change"]) for r in rows)
        out.append({"share": share, "master_rate": master_rate, "donors": rows,
                    "worst_change": max(0.0, worst),
                    "lent_blocks": lending.lent_blocks,
                    "reclaimed_blocks": lending.reclaimed_blocks,
                    "master_ttft_p99": lending.master["ttft_p99"],
                    "master_stable": lending.master["stable"],
                    "master_donor_hit": lending.master["hit_rate"].get("donor", 0.0),
                    "master_load_failures": lending.master["load_failures"]})
        if progress:
            progress(f"donors at {share:.0%} of their goodput: worst change {worst:+.1%}, "
                     f"reclaimed {lending.reclaimed_blocks} of {lending.lent_blocks} blocks")
    return out


def reductions(sweep: list[dict], base: str = "sglang-hicache", ours: str = OURS) -> list[dict]:
    """Per swept rate: P99 TTFT of `base` and `ours`, the reduction, and whether each was stable."""
    by = {(r["system"], r["rate"]): r["master"] for r in sweep}
    rows = []
    for rate in sorted({r["rate"] for r in sweep}):
        b, o = by.get((base, rate)), by.get((ours, rate))
        if b and o and b["ttft_p99"]:
            rows.append({"rate": rate, "base_p99": b["ttft_p99"], "ours_p99": o["ttft_p99"],
                         "reduction": 1.0 - o["ttft_p99"] / b["ttft_p99"],
                         "stable_base": b["stable"], "stable_ours": o["stable"]})
    return rows


def capacity_table(scn: Scenario, fractions=(0.25, 0.5, 0.75)) -> dict:
    """The high-demand model's maximum context (the stepwise streaming sweep, long_context.py) at
    the scenario's lend fraction and at each of `fractions`."""
    def at(f):
        res = max_context(LongContext(scn.name, scn.gpu, scn.master, scn.donors, f))
        res.pop("probes")
        return res
    return {"default": at(scn.lend_fraction), "sensitivity": [at(f) for f in fractions]}
