"""Percentile tables and per-turn cache-hit rates from request records (plain dicts or records)."""

from __future__ import annotations

import numpy as np


def _get(r, k):
    return r[k] if isinstance(r, dict) else getattr(r, k)


def pct(values, q: float) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.percentile(vals, q)) if vals else None


def summarize(records) -> dict:
    ok = [r for r in records if not _get(r, "error") and _get(r, "ttft") is not None]
    ttft = [_get(r, "ttft") for r in ok]
    e2e = [_get(r, "e2e") for r in ok]
    itl = [x for r in ok for x in _get(r, "itls")]
    prompt = sum(_get(r, "prompt_tokens") or 0 for r in ok)
    cached_known = [r for r in ok if _get(r, "cached_tokens") is not None]
    cached = sum(_get(r, "cached_tokens") for r in cached_known)
    prompt_known = sum(_get(r, "prompt_tokens") or 0 for r in cached_known)
    out = {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "prompt_tokens": prompt,
        "cache_hit_rate": (cached / prompt_known) if prompt_known else None,
    }
    for name, vals in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = pct(vals, q)
    per_turn: dict[int, dict] = {}
    for turn in sorted({_get(r, "turn") for r in ok}):
        rs = [r for r in ok if _get(r, "turn") == turn]
        known = [r for r in rs if _get(r, "cached_tokens") is not None and _get(r, "prompt_tokens")]
        p = sum(_get(r, "prompt_tokens") for r in known)
        per_turn[turn] = {
            "n": len(rs),
            "ttft_p50": pct([_get(r, "ttft") for r in rs], 50),
            "ttft_p99": pct([_get(r, "ttft") for r in rs], 99),
            "prompt_tokens_mean": (sum(_get(r, "prompt_tokens") or 0 for r in rs) / len(rs)),
            "hit_rate": (sum(_get(r, "cached_tokens") for r in known) / p) if p else None,
        }
    out["per_turn"] = per_turn
    return out


def _ms(v):
    return "-" if v is None else f"{v * 1e3:.1f}"


def format_summary(label: str, s: dict) -> str:
    hit = "-" if s["cache_hit_rate"] is None else f"{s['cache_hit_rate']:.1%}"
    wall = f", {s['wall_s']:.1f} s" if s.get("wall_s") is not None else ""
    lines = [f"== {label}: {s['ok']}/{s['requests']} ok{wall}, "
             f"prompt tokens {s['prompt_tokens']}, cache hit {hit}",
             f"{'metric (ms)':<12}{'P50':>10}{'P90':>10}{'P99':>10}"]
    for name in ("ttft", "itl", "e2e"):
        lines.append(f"{name:<12}" + "".join(f"{_ms(s[f'{name}_p{q}']):>10}" for q in (50, 90, 99)))
    lines.append(f"{'turn':<6}{'n':>5}{'TTFT P50':>10}{'TTFT P99':>10}{'prompt':>9}{'hit':>8}")
    for t, d in s["per_turn"].items():
        h = "-" if d["hit_rate"] is None else f"{d['hit_rate']:.0%}"
        lines.append(f"{t:<6}{d['n']:>5}{_ms(d['ttft_p50']):>10}{_ms(d['ttft_p99']):>10}"
                     f"{d['prompt_tokens_mean']:>9.0f}{h:>8}")
    return "\n".join(lines)


def ratios(base: dict, other: dict) -> dict:
    """other / base for each latency percentile (values < 1 mean `other` is faster)."""
    out = {}
    for name in ("ttft", "itl", "e2e"):
        for q in (50, 90, 99):
            a, b = base.get(f"{name}_p{q}"), other.get(f"{name}_p{q}")
            out[f"{name}_p{q}"] = (b / a) if a and b is not None else None
    return out
