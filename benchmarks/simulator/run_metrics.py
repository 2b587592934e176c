"""What one simulated run measured for one server: latency percentiles, hit rates, stability."""

from __future__ import annotations

import numpy as np

from .server import SimRequest


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def metrics(reqs: list[SimRequest], end: float) -> dict:
    """Percentiles of TTFT (s) and TPOT (s/token), hit rate per tier, load-back times.

    Requests still without a first token at `end` count with the time they have waited so far, so
    an overloaded server's P99 grows with the run instead of hiding its queue.
    """
    done = [r for r in reqs if r.first_token is not None]
    ttft = [r.ttft for r in done] + [end - r.arrival for r in reqs
                                     if r.first_token is None and not r.rejected]
    tpot = [float(np.mean(r.itls)) for r in done if r.itls]
    prompt = sum(r.prompt_tokens for r in done)
    hit = {}
    for r in done:
        for tier, n in r.hit_tokens.items():
            hit[tier] = hit.get(tier, 0) + n
    loads = [r.load_time for r in done if r.load_time is not None]
    return {
        "requests": len(reqs), "first_token": len(done), "rejected": sum(r.rejected for r in reqs),
        "ttft_p50": _pct(ttft, 50), "ttft_p90": _pct(ttft, 90), "ttft_p99": _pct(ttft, 99),
        "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99),
        "hit_rate": {k: v / prompt for k, v in hit.items()} if prompt else {},
        "load_p99": _pct(loads, 99), "loads": len(loads),
        "peak_live_tokens": peak_live_tokens(reqs, end),
    }


def peak_live_tokens(reqs: list[SimRequest], end: float) -> int:
    """The most KV (tokens) the sessions in progress held at once: a session holds its latest
    turn's prompt + answer from that turn's arrival until its next turn arrives (its history
    grows) or, after its last turn, until that turn finishes (or `end`). The working set a cache
    would need to miss nothing but first turns."""
    by: dict[str, list[SimRequest]] = {}
    for r in reqs:
        by.setdefault(r.session, []).append(r)
    deltas: list[tuple[float, int]] = []
    for turns in by.values():
        turns.sort(key=lambda r: r.turn)
        held = 0
        for r in turns:
            size = r.prompt_tokens + r.output_tokens
            deltas.append((r.arrival, size - held))
            held = size
        last = turns[-1]
        deltas.append((last.finish if last.finish is not None else end, -held))
    live = peak = 0
    for _, d in sorted(deltas, key=lambda x: (x[0], x[1])):  # releases first at equal times
        live += d
        peak = max(peak, live)
    return peak


def stable(queue: list[tuple[float, int]], window: float) -> bool:
    """Not overloaded: the waiting queue in the last quarter of the arrival window is on average
    no longer than twice that of the second quarter plus 2 requests (it is not growing).

    `queue` holds (time, requests waiting) samples taken over the arrival window.
    """
    def mean(lo, hi):
        xs = [n for t, n in queue if lo <= t < hi]
        return sum(xs) / len(xs) if xs else 0.0
    return mean(0.75 * window, window) <= 2 * mean(0.25 * window, 0.5 * window) + 2
