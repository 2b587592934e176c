"""The regime grid (SIMULATED): where the donor tier pays, cell by cell.

A cell is the busy model's traffic and its host: think time, minimum turns per conversation,
HiCache's host memory and the effective PCIe bandwidth, for chat or agent traffic on the paper's
node. In each cell HiCache, HiCache + SwiftCache (the live tiers: device, donor pages while lent,
host; scenario.py) and the ideal (the lease held in the busy device pool) are each given their
goodput, then run at 50%, 80% and 95% of HiCache's goodput. Donors are idle (their own traffic
and what it costs them are `--quick`'s interference figures), so the lease is whole.

`predict` is computed from the traffic alone, before any system runs: the compute-bound rate
(sessions/s an idle-queue GPU prefills with every history cached) and, by Little's law, the KV
the sessions in progress hold at that rate, against device + host and device + donor + host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import experiments as ex
from . import goodput as gp
from . import params
from .capacity import master_tier_pages, page_bytes
from .scenario import PAPER, Scenario, master_sessions

HICACHE, OURS, IDEAL = "sglang-hicache", "swiftcache", "ideal"
SYSTEMS = (HICACHE, OURS, IDEAL)
LOAD_SHARES = (0.5, 0.8, 0.95)  # of HiCache's goodput
START_SHARE = 0.125  # HiCache's search starts at this share of the compute-bound rate
GRID = dict(workload=("chat", "agent"), think_s=(10.0, 60.0, 300.0), min_turns=(1, 4),
            host_gb=(32.6, 65.0, 100.0), pcie_gbps=(32.0, 16.0, 8.0))


@dataclass(frozen=True)
class Cell:
    workload: str  # chat | agent
    think_s: float  # chat: mean think time; agent: mean tool time between turns
    min_turns: int  # chat: shorter conversations skipped; agent: at least this many steps
    host_gb: float  # HiCache's host tier (the same in SwiftCache and the ideal)
    pcie_gbps: float  # effective PCIe bandwidth per direction

    @property
    def key(self) -> str:
        return (f"{self.workload}/think{self.think_s:g}/turns{self.min_turns}/"
                f"host{self.host_gb:g}/pcie{self.pcie_gbps:g}")

    def scenario(self, base: Scenario = PAPER) -> Scenario:
        think = dict(think_mean_s=self.think_s) if self.workload == "chat" else dict(
            tool_latency_s=self.think_s)
        return replace(base, workload=self.workload, min_turns=self.min_turns,
                       host_bytes=self.host_gb * 1e9, pcie_bw=self.pcie_gbps * 1e9, **think)


# Chosen for the paper's node before the grid ran (docs/simulation.md section 9): ShareGPT chat,
# a minute to read an answer and write the next turn, conversations of four turns or more (the
# paper's 90.7% prefix hits for ShareGPT multi-turn need long conversations), 32.6 GB of host
# memory per GPU (128 GB for four GPUs; --hicache-ratio 2) and the quoted 32 GB/s of PCIe.
REALISTIC = Cell("chat", 60.0, 4, 32.6, 32.0)


def cells(workloads=GRID["workload"], think_s=GRID["think_s"], min_turns=GRID["min_turns"],
          host_gb=GRID["host_gb"], pcie_gbps=GRID["pcie_gbps"]) -> list[Cell]:
    """Every combination; agent cells take one minimum-turns value (agent loops have 8-20 steps,
    so minimum turns up to 8 change nothing)."""
    out = []
    for w in workloads:
        for t in think_s:
            for m in (min_turns if w == "chat" else min_turns[:1]):
                for h in host_gb:
                    for p in pcie_gbps:
                        out.append(Cell(w, float(t), int(m), float(h), float(p)))
    return out


def memory_tokens(scn: Scenario) -> dict[str, int]:
    """Tokens of the busy model's KV: HiCache's device + host, SwiftCache's device + donor +
    host (what the runs have)."""
    h = master_tier_pages(scn, True, False)
    s = master_tier_pages(scn, True, True)
    tok = page_bytes(scn.master) // params.MODELS[scn.master].kv_bytes_per_token
    return {"device_plus_host": (h["device"] + h["host"]) * tok,
            "device_plus_donor_plus_host": (s["device"] + s["donor"] + s["host"]) * tok}


def predict(cell: Cell, seed: int = 0, window: float = gp.REFERENCE_WINDOW_S) -> dict:
    """From the traffic alone: the prefill-bound session rate (every history cached, decode and
    queueing left out, so an upper bound on any system's goodput), the live KV per unit of
    session rate (Little's law: each turn's history held over the wait before the next turn) and
    the rates at which that live KV fills device + host and device + donor + host."""
    scn = cell.scenario()
    sessions = master_sessions(scn, gp.REFERENCE_RATE, window, seed)
    busy = sum(gp.unloaded_ttfts(scn, scn.master, sessions))  # prefill seconds, all cached
    knee = len(sessions) / busy
    # each turn's history (prompt + answer) is held for the wait before the next turn
    held = 0.0
    for s in sessions:
        ctx = 0
        for k, t in enumerate(s.turns):
            ctx += t.new_tokens + t.output_tokens
            if k + 1 < len(s.turns):
                held += ctx * t.think_s
    per_rate = held / len(sessions)  # live tokens per session/s
    mem = memory_tokens(scn)
    return {"prefill_bound_rate": knee, "live_tokens_per_rate": per_rate, **mem,
            "rate_filling_device_plus_host": mem["device_plus_host"] / per_rate,
            "rate_filling_all_tiers": mem["device_plus_donor_plus_host"] / per_rate}


def search(master_at, slo_s: float, start: float, refine_steps: int,
           max_steps: int = 8) -> gp.Goodput:
    """Goodput on the ladder start * 2^k: the last rung sustained with every rung below it
    sustained (halving from `start` while it fails), then `refine_steps` bisections up to the
    first rung that fails. `lower_bound`: no rung failed."""
    rate = start
    for _ in range(max_steps):  # down until a rung is sustained
        if gp.sustains(master_at(rate), slo_s):
            break
        rate /= 2
    else:
        return gp.Goodput(0.0, False, slo_s)
    lo, hi = rate, None
    for _ in range(max_steps):
        if not gp.sustains(master_at(lo * 2), slo_s):
            hi = lo * 2
            break
        lo *= 2
    if hi is None:
        return gp.Goodput(lo, True, slo_s)
    for _ in range(refine_steps):
        mid = (lo + hi) / 2
        if gp.sustains(master_at(mid), slo_s):
            lo = mid
        else:
            hi = mid
    return gp.Goodput(lo, False, slo_s)


def _pick(m: dict) -> dict:
    return {"ttft_p99": m["ttft_p99"], "stable": m["stable"],
            "hits": {k: round(v, 4) for k, v in m["hit_rate"].items()}}


def evaluate(cell: Cell, seed: int, window: float, refine_steps: int, progress=None,
             write_through: bool = False) -> dict:
    """One cell, one seed: each system's goodput, then every system at each share of HiCache's
    goodput (P99 TTFT, hits by tier), and the live KV at HiCache's goodput."""
    scn = replace(cell.scenario(), write_through=write_through)
    pred = predict(cell, seed)
    slo = gp.master_slo_s(scn, seed)
    points = ex.Points(scn, window, seed, progress)
    start = START_SHARE * pred["prefill_bound_rate"]  # one ladder for every system
    good = {s: search(lambda r, s=s: points.master(s, r), slo, start, refine_steps)
            for s in SYSTEMS}
    base = good[HICACHE].rate
    at = {}
    for share in LOAD_SHARES:
        if base <= 0:
            break
        at[str(share)] = {s: _pick(points.master(s, share * base)) for s in SYSTEMS}
    knee_run = points.master(HICACHE, base) if base > 0 else None
    return {"cell": cell.key, "seed": seed, "slo_s": slo, "prediction": pred,
            "goodput": {s: g.rate for s, g in good.items()},
            "goodput_is_lower_bound": {s: g.lower_bound for s, g in good.items()},
            "at_share": at,
            "peak_live_tokens_at_hicache_goodput": (knee_run["peak_live_tokens"]
                                                    if knee_run else None),
            "runs": len(points.runs)}


def _ratio(a, b):
    return a / b if a is not None and b else None


def reduce_seeds(rows: list[dict]) -> dict:
    """One cell over its seeds: median, min and max of each headline figure."""
    def stats(xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            return None
        return {"median": round(float(np.median(xs)), 4), "min": round(min(xs), 4),
                "max": round(max(xs), 4)}

    out = {"seeds": [r["seed"] for r in rows],
           "goodput_ratio_vs_hicache": stats([_ratio(r["goodput"][OURS], r["goodput"][HICACHE])
                                              for r in rows]),
           "ideal_goodput_ratio_vs_hicache": stats([_ratio(r["goodput"][IDEAL],
                                                           r["goodput"][HICACHE]) for r in rows]),
           "hicache_goodput": stats([r["goodput"][HICACHE] for r in rows])}
    for share in LOAD_SHARES:
        k = str(share)
        for s, name in ((OURS, "p99_ttft_reduction"), (IDEAL, "ideal_p99_ttft_reduction")):
            out[f"{name}_at_{round(share * 100)}pct"] = stats([
                1 - r["at_share"][k][s]["ttft_p99"] / r["at_share"][k][HICACHE]["ttft_p99"]
                if k in r["at_share"] and r["at_share"][k][HICACHE]["ttft_p99"] else None
                for r in rows])
    hits = {}
    for s in SYSTEMS:
        tiers = {t for r in rows if "0.8" in r["at_share"] for t in r["at_share"]["0.8"][s]["hits"]}
        hits[s] = {t: round(float(np.median([r["at_share"]["0.8"][s]["hits"].get(t, 0.0)
                                             for r in rows if "0.8" in r["at_share"]])), 4)
                   for t in sorted(tiers)}
    out["hits_by_tier_at_80pct"] = hits
    mem = rows[0]["prediction"]
    kv = params.MODELS[PAPER.master].kv_bytes_per_token
    peak = stats([r["peak_live_tokens_at_hicache_goodput"] for r in rows])
    out["peak_live_over_device_plus_host"] = (
        None if peak is None else round(peak["median"] / mem["device_plus_host"], 3))
    out["peak_live_gb"] = None if peak is None else round(peak["median"] * kv / 1e9, 1)
    out["device_plus_host_gb"] = round(mem["device_plus_host"] * kv / 1e9, 1)
    out["all_tiers_gb"] = round(mem["device_plus_donor_plus_host"] * kv / 1e9, 1)
    out["rate_filling_device_plus_host"] = round(float(np.median(
        [r["prediction"]["rate_filling_device_plus_host"] for r in rows])), 4)
    return out
