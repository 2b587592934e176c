"""Goodput: the highest session rate a server sustains with its P99 TTFT under an SLO (SIMULATED).

The SLO. P99 TTFT <= SLO_FACTOR x the P99 of the *unloaded* TTFT of the same traffic, where a
request's unloaded TTFT is the roofline time to prefill its new tokens on an idle GPU with its
history already cached (what the hardware needs for that request with no queue and no miss; the
shared system prompt of agent sessions counts as cached). Why a multiple of the unloaded tail and
not a fixed number of seconds: the same bar then means the same thing on an H20 and an H200 and for
a 4B donor and a 32B master (Qwen3-32B on an H20 needs ~1.6 s for the P99 ShareGPT turn alone, a
Qwen3-4B ~0.2 s); a factor of 5 lets queueing and cache misses add up to 4x the tail's own work
before a load counts as too high. SLOs written as a multiple of unloaded latency, swept to show
how tight they are, are how serving papers state them (DistServe, arXiv 2401.09670, "SLO scale");
the CLI reports the goodput ratio at factors 2 and 10 as well, so the choice can be judged.

Sustained at a rate: P99 TTFT <= SLO and `stable` (the waiting queue did not grow over the arrival
window, run_metrics.stable). Goodput: the highest rate sustained with every lower swept rate
sustained too, refined by bisection between it and the first rate that fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import params
from .roofline import Roofline
from .scenario import Scenario, donor_name, donor_sessions, master_sessions, run_point

SLO_FACTOR = 5.0
# traffic drawn to measure the unloaded TTFT distribution (its shape does not depend on the rate)
REFERENCE_RATE = 1.0
REFERENCE_WINDOW_S = 600.0


def unloaded_ttfts(scn: Scenario, model_name: str, sessions) -> list[float]:
    """Each request's TTFT alone on an idle GPU: prefill of its new tokens (in chunks of SGLang's
    chunked-prefill size) over its cached history."""
    m = params.MODELS[model_name]
    hw = params.gpu(scn.gpu)
    rl = Roofline(m, hw["bf16_flops"], hw["hbm_bw"], params.EFFICIENCY["compute"].value,
                  params.EFFICIENCY["hbm"].value)
    chunk = int(params.SGLANG["chunked_prefill_size"].value)
    out = []
    for s in sessions:
        ctx = s.shared_prefix_tokens  # a prompt every session shares is hot in any cache
        for k, t in enumerate(s.turns):
            new = t.new_tokens - (s.shared_prefix_tokens if k == 0 else 0)
            took, done = 0.0, 0
            while done < new:
                n = min(chunk, new - done)
                took += rl.step_time([(n, ctx + done)])
                done += n
            out.append(took)
            ctx += new + t.output_tokens
    return out


def master_slo_s(scn: Scenario, seed: int = 0, factor: float = SLO_FACTOR) -> float:
    """The P99 TTFT SLO (s) of the high-demand model under `scn`'s master workload."""
    sessions = master_sessions(scn, REFERENCE_RATE, REFERENCE_WINDOW_S, seed)
    return factor * float(np.percentile(unloaded_ttfts(scn, scn.master, sessions), 99))


def donor_slos_s(scn: Scenario, seed: int = 0, factor: float = SLO_FACTOR) -> list[float]:
    """The P99 TTFT SLO (s) of each donor under its own chat traffic, in `scn.donors` order."""
    return [factor * float(np.percentile(unloaded_ttfts(
        scn, model, donor_sessions(scn, i, REFERENCE_RATE, REFERENCE_WINDOW_S, seed)), 99))
        for i, model in enumerate(scn.donors)]


def sustains(m: dict, slo_s: float) -> bool:
    """P99 TTFT within the SLO and the waiting queue not growing."""
    return m.get("ttft_p99") is not None and m["ttft_p99"] <= slo_s and bool(m.get("stable"))


@dataclass(frozen=True)
class Goodput:
    rate: float  # sessions/s; 0.0 when even the lowest rate tried fails
    lower_bound: bool  # every swept rate was sustained: the goodput is at least `rate`
    slo_s: float


def goodput(master_at: Callable[[float], dict], rates, slo_s: float, refine_steps: int) -> Goodput:
    """Goodput of one system: `master_at(rate)` gives its metrics at a rate (runs or looks up);
    `rates` is the swept grid, then `refine_steps` bisections between the last rate sustained
    (every lower one sustained too) and the first that fails."""
    lo, hi = 0.0, None
    for rate in sorted(rates):
        if not sustains(master_at(rate), slo_s):
            hi = rate
            break
        lo = rate
    if hi is None:
        return Goodput(lo, True, slo_s)
    for _ in range(refine_steps):
        mid = (lo + hi) / 2
        if sustains(master_at(mid), slo_s):
            lo = mid
        else:
            hi = mid
    return Goodput(lo, False, slo_s)


def donor_goodputs(scn: Scenario, window: float, seed: int = 0, *, factor: float = SLO_FACTOR,
                   refine_steps: int = 3, start_rate: float = 0.5, max_rate: float = 256.0,
                   progress=None) -> tuple[list[float], list[float]]:
    """Each donor's goodput (chat sessions/s) serving its own traffic alone, and its SLO (s).

    Rates double from `start_rate` until one fails, then bisect `refine_steps` times; all donors
    advance together in one run per step (alone, they do not interact).
    """
    slos = donor_slos_s(scn, seed, factor)
    n = len(scn.donors)
    lo, hi = [0.0] * n, [None] * n
    rate, left = [start_rate] * n, [refine_steps] * n
    while any(h is None or k > 0 for h, k in zip(hi, left)):
        active = [i for i in range(n) if hi[i] is None or left[i] > 0]
        rates = tuple(rate[i] if i in active else 0.0 for i in range(n))
        run = run_point(scn, "sglang-radix", 0.0, window, seed=seed, with_master=False, lend=False,
                        donor_rates=rates)
        for i in active:
            ok = sustains(run.donors[donor_name(scn, i)], slos[i])
            if hi[i] is None:  # bracketing: double until a rate fails
                if ok:
                    lo[i] = rate[i]
                    if rate[i] * 2 > max_rate:
                        raise RuntimeError(f"{donor_name(scn, i)} sustains {rate[i]} sessions/s "
                                           f"alone; raise max_rate")
                    rate[i] *= 2
                    continue
                hi[i] = rate[i]
            else:  # refining: bisect the bracket
                lo[i], hi[i] = (rate[i], hi[i]) if ok else (lo[i], rate[i])
                left[i] -= 1
            rate[i] = (lo[i] + hi[i]) / 2
        if progress:
            progress(f"{scn.name} donors alone at {', '.join(f'{r:.3g}' for r in rates)} "
                     f"sessions/s")
    return lo, slos
