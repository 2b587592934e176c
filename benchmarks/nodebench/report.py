"""What the node benchmark reports: outputs against stock, cached tokens, TTFT, the reclaim, the
JSON summary (its keys defined in `summarize`) and the capacity plot."""

from __future__ import annotations

from typing import Any

from ..loadgen.stats import pct
from ..tools.demo import per_turn_table

STREAMS = ("busy", "donor", "burst", "busy_reclaim")  # a run's record streams (traffic.py)


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den rounded to 3 places; None when either is missing or den is 0."""
    if num is None or not den:
        return None
    return round(num / den, 3)


def same_output(got, want) -> bool:
    """Two greedy outputs are the same: equal token ids, and not both empty (an empty answer
    on both sides, a refused or failed request, compares nothing)."""
    return bool(got) and list(got) == list(want)


def compare_outputs(base: dict[str, list], other: dict[str, list]) -> dict:
    """Every request of `base` looked up in `other` by (stream, session, turn), token ids
    compared (`same_output`). A request missing from `other`, or empty in both, counts as a
    mismatch."""
    theirs = {(s, r.session, r.turn): r.output_ids for s in STREAMS for r in other.get(s, [])}
    mismatches = [(s, r.session, r.turn) for s in STREAMS for r in base.get(s, [])
                  if not same_output(theirs.get((s, r.session, r.turn)), r.output_ids)]
    compared = sum(len(base.get(s, [])) for s in STREAMS)
    return {"compared": compared, "matched": compared - len(mismatches),
            "mismatches": [list(m) for m in mismatches]}


def stream_stats(records: list) -> dict:
    """Requests, prompt and cached tokens, TTFT P50 / P99 / mean in ms (None without requests)."""
    ttft = [r.ttft * 1e3 for r in records if r.ttft is not None]
    p50, p99 = pct(ttft, 50), pct(ttft, 99)
    return {"requests": len(records),
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in records),
            "cached_tokens": sum(r.cached_tokens or 0 for r in records),
            "ttft_p50_ms": None if p50 is None else round(p50, 1),
            "ttft_p99_ms": None if p99 is None else round(p99, 1),
            "ttft_mean_ms": round(sum(ttft) / len(ttft), 1) if ttft else None}


def run_tables(records: dict[str, list]) -> dict:
    """Per stream, the donor's two streams together (`donor_all`), and the busy model per turn
    (steady phase)."""
    out = {s: stream_stats(records.get(s, [])) for s in STREAMS}
    out["donor_all"] = stream_stats(records.get("donor", []) + records.get("burst", []))
    out["busy_per_turn"] = per_turn_table(records.get("busy", []))
    return out


def reclaim_view(sampler: Any, bursts: list[tuple[float, float]],
                 reclaims_done: list[float | None] | None = None) -> dict:
    """The donor's capacity around each of its bursts (`bursts`: (start, end) per round, in
    time order): what it had lent when the burst began (sampled gauge), and whether its whole
    pool was usable again before its next burst. That shows either in a sample (`full_after_s`:
    the first sample after the burst began with the whole pool usable; the gauges are updated
    once a second, so an upper bound with ~1 s slack) or in `reclaims_done[r]`, the reclaims the
    donor completed between the readings of its reclaim counter before round r and before the
    next (`swiftcache_reclaim_latency_seconds_count`: it counts one when the last page it
    demanded is back in its pool, nothing lent, the whole pool usable), since the sampler is
    off during the other donors' bursts and can miss the window before the relend.
    `lent_at_burst` and `full_after_s` of the view are the first round's and the slowest
    sampled round's."""
    pool = sampler.peak("donor", "swiftcache_kv_pool_tokens")
    lent = sampler.series("donor", "swiftcache_lent_tokens")
    usable = sampler.series("donor", "swiftcache_usable_tokens")
    view = {"pool_tokens": pool, "lent_at_burst": None, "full_after_burst": False,
            "full_after_s": None, "rounds": [],
            "max_lent_tokens": sampler.peak("donor", "swiftcache_lent_tokens")}
    if pool is None or not bursts:
        return view
    starts = [start for start, _ in bursts]
    done = list(reclaims_done or []) + [None] * len(starts)
    backs = []
    for r, (start, nxt) in enumerate(zip(starts, starts[1:] + [float("inf")])):
        before = [v for t, v in lent if t <= start]
        back = [t for t, v in usable if start <= t < nxt and v >= pool]
        row = {"lent_at_burst": before[-1] if before else None,
               "full_after_s": round(back[0] - start, 2) if back else None}
        if reclaims_done is not None:
            row["reclaims"] = done[r]
        view["rounds"].append(row)
        backs.append(bool(back) or bool(done[r]))
    view["lent_at_burst"] = view["rounds"][0]["lent_at_burst"]
    view["full_after_burst"] = all(backs)
    sampled = [r["full_after_s"] for r in view["rounds"] if r["full_after_s"] is not None]
    view["full_after_s"] = max(sampled) if sampled else None
    return view


def burst_rounds_in_trace(trace: list[dict], tokens_per_round: list[int]) -> list[list[dict]]:
    """The donor's bursts in a --diagnose forward trace (one dict per forward pass, in order):
    walking back from the end, each round's prefill (EXTEND) passes, whose new tokens add up to
    that round's prompt tokens less its cached ones (`tokens_per_round`, first round first).
    The bursts are the donor's last traffic and only their decode steps lie between them. A
    round whose passes do not add up exactly (a trace cut short) is [], and so is every round
    before it."""
    found: list[list[dict]] = []
    i = len(trace)
    for tokens in reversed(tokens_per_round):
        passes, total = [], 0
        while i > 0 and total < tokens:
            i -= 1
            if trace[i].get("mode") == "EXTEND":
                passes.append(trace[i])
                total += int(trace[i]["new_tokens"])
        if total != tokens:
            break
        found.append(passes[::-1])
    found += [[]] * (len(tokens_per_round) - len(found))
    return found[::-1]


def burst_split(ttft_ms: float | None, forwards: list[dict]) -> dict | None:
    """One burst's TTFT (its slowest request's) split into its prefill passes (wall and thread
    CPU ms) and the rest (`outside_ms`: queueing, scheduling, a wait for lent pages, the HTTP
    path). The same forward's CPU time moves 10-20% within seconds on this shared 2-core machine
    (docs/node_bench.md), so `outside_ms` is where SwiftCache's own cost to the donor shows."""
    if ttft_ms is None or not forwards:
        return None
    wall = sum(f["wall_ms"] for f in forwards)
    return {"ttft_ms": round(ttft_ms, 1), "forwards": len(forwards),
            "forward_wall_ms": round(wall, 1),
            "forward_cpu_ms": round(sum(f["cpu_ms"] for f in forwards), 1),
            "outside_ms": round(ttft_ms - wall, 1)}


def summarize(tables: dict[str, dict], outputs: dict[str, dict], reclaim: dict,
              reclaim_latency_s: float | None) -> dict:
    """The JSON summary. `tables`, `outputs` are keyed by run ("a" stock, "b" SwiftCache,
    "c" ideal); `outputs[x]` compares run x to run a. Keys:
    identical             every busy and donor output of (b) and (c) equals (a)'s, request by
                          request, both phases
    busy_cached_ratio     cached tokens of the busy model in the steady phase, (b) / (a)
    busy_cached_vs_ideal  the same, (b) / (c)
    busy_ttft_p99_ratio   TTFT P99 over the busy model's steady-phase requests, (b) / (a)
    busy_ttft_p99_vs_ideal  the same, (b) / (c)
    donor_ttft_p99_ratio  TTFT P99 over all donor requests (light and every round's burst),
                          (b) / (a)
    reclaimed             in (b) the donor had pages lent when each of its bursts began, and its
                          usable capacity was back to its whole pool before its next burst (a
                          sample showed it, or its reclaim counter: `reclaim_view`)
    The busy model's reclaim-phase figures (its turns after the burst) are beside them
    (`busy_reclaim_*`), not in them."""
    busy = {k: t["busy"] for k, t in tables.items()}
    donor = {k: t["donor_all"] for k, t in tables.items()}
    identical = {"b", "c"} <= outputs.keys() and all(
        o["matched"] == o["compared"] > 0 for k, o in outputs.items() if k != "a")

    def get(stats: dict, run: str, key: str):
        return stats.get(run, {}).get(key)

    return {
        "identical": identical,
        "busy_cached_ratio": ratio(get(busy, "b", "cached_tokens"),
                                   get(busy, "a", "cached_tokens")),
        "busy_cached_vs_ideal": ratio(get(busy, "b", "cached_tokens"),
                                      get(busy, "c", "cached_tokens")),
        "busy_ttft_p99_ratio": ratio(get(busy, "b", "ttft_p99_ms"), get(busy, "a", "ttft_p99_ms")),
        "busy_ttft_p99_vs_ideal": ratio(get(busy, "b", "ttft_p99_ms"),
                                        get(busy, "c", "ttft_p99_ms")),
        "donor_ttft_p99_ratio": ratio(get(donor, "b", "ttft_p99_ms"),
                                      get(donor, "a", "ttft_p99_ms")),
        "reclaimed": bool(reclaim.get("rounds")) and reclaim.get("full_after_burst", False)
        and all(r["lent_at_burst"] for r in reclaim["rounds"]),
        "reclaim_latency_s": reclaim_latency_s,
        "busy_cached_tokens": {k: v["cached_tokens"] for k, v in busy.items()},
        "busy_reclaim_cached_tokens": {k: t["busy_reclaim"]["cached_tokens"]
                                       for k, t in tables.items()},
        "busy_reclaim_ttft_p99_ms": {k: t["busy_reclaim"]["ttft_p99_ms"]
                                     for k, t in tables.items()},
        "busy_ttft_p99_ms": {k: v["ttft_p99_ms"] for k, v in busy.items()},
        "donor_ttft_p99_ms": {k: v["ttft_p99_ms"] for k, v in donor.items()},
        "outputs_matched": {k: f"{o['matched']}/{o['compared']}" for k, o in outputs.items()},
    }


def noise_floor(tables: dict[str, dict], twin: Any | None) -> dict:
    """The donor bursts' TTFT P99 and mean per donor (runs a, b, c, and the twin t when there is
    one) and `donor_ttft_p99_noise`: the twin's burst TTFT P99 / (a)'s. The twin is a second
    stock donor identical to (a)'s whose bursts went in the same rounds (`runner.DonorTwin`), so
    the ratio is what two identical servers differ by here: `donor_ttft_p99_ratio` is within the
    machine's noise where it is no further from 1 than this (None without a twin). A burst's
    requests share one prefill, so a P99 over the rounds is about their slowest burst; the mean
    over every burst request is beside it, with the same two ratios: `donor_burst_mean_ratio`
    ((b) / (a)) and `donor_burst_mean_noise` ((t) / (a))."""
    p99 = {k: t["burst"]["ttft_p99_ms"] for k, t in tables.items()}
    mean = {k: t["burst"]["ttft_mean_ms"] for k, t in tables.items()}
    noise = mean_noise = None
    if twin is not None:
        stats = stream_stats(twin.records.get("burst", []))
        p99["t"], mean["t"] = stats["ttft_p99_ms"], stats["ttft_mean_ms"]
        noise, mean_noise = ratio(p99["t"], p99.get("a")), ratio(mean["t"], mean.get("a"))
    return {"donor_burst_p99_ms": p99, "donor_ttft_p99_noise": noise,
            "donor_burst_mean_ms": mean,
            "donor_burst_mean_ratio": ratio(mean.get("b"), mean.get("a")),
            "donor_burst_mean_noise": mean_noise}


def format_run(name: str, tables: dict) -> str:
    head = f"{'stream':<13}{'reqs':>5}{'prompt tok':>11}{'cached tok':>11}{'TTFT p50 ms':>12}" \
           f"{'TTFT p99 ms':>12}"
    lines = [f"== {name} ==", head]
    for stream in ("busy", "busy_reclaim", "donor", "burst", "donor_all"):
        s = tables[stream]
        lines.append(f"{stream:<13}{s['requests']:>5}{s['prompt_tokens']:>11}"
                     f"{s['cached_tokens']:>11}{_num(s['ttft_p50_ms']):>12}"
                     f"{_num(s['ttft_p99_ms']):>12}")
    lines.append("busy model per turn (steady phase):")
    lines.append(f"{'turn':>6}{'reqs':>5}{'prompt tok':>11}{'cached tok':>11}{'TTFT p50 ms':>12}"
                 f"{'TTFT p99 ms':>12}")
    for r in tables["busy_per_turn"]:
        lines.append(f"{r['turn']:>6}{r['requests']:>5}{r['prompt_tokens']:>11}"
                     f"{r['cached_tokens']:>11}{_num(r['ttft_p50_ms']):>12}"
                     f"{_num(r['ttft_p99_ms']):>12}")
    return "\n".join(lines)


def _num(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def plot_capacity(path, runs: dict[str, Any], facts: dict[str, Any]) -> None:
    """Donor usable / lent tokens over time in (b) against the donor pools of (a) and (c), and the
    busy server's borrowed and donor-tier tokens (its own tokens); the bursts shaded. The
    sampler is off while the other runs serve their steady phase (a gap in the lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = runs["b"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, label in (("swiftcache_usable_tokens", "donor usable (b)"),
                        ("swiftcache_lent_tokens", "donor lent (b)")):
        pts = b.sampler.series("donor", name)
        top.step([t for t, _ in pts], [v for _, v in pts], where="post", label=label)
    for key, style in (("a", ":"), ("c", "--")):
        if key in runs:
            top.axhline(runs[key].pools["donor"], linestyle=style, color="gray",
                        label=f"donor pool ({key}, stock)")
    for name, label in (("swiftcache_borrowed_tokens", "busy: borrowed (b)"),
                        ("swiftcache_donor_tier_tokens", "busy: cached in donor memory (b)")):
        pts = b.sampler.series("busy", name)
        bottom.step([t for t, _ in pts], [v for _, v in pts], where="post", label=label)
    for i, (start, end) in enumerate(b.marks.bursts):
        for ax in (top, bottom):
            ax.axvspan(start, max(end, start + 0.3), color="orange", alpha=0.3,
                       label=None if i else "donor bursts (b)")
    top.set_ylabel(f"donor tokens ({facts['donor'].kv_bytes_per_token} B)")
    bottom.set_ylabel(f"busy tokens ({facts['busy'].kv_bytes_per_token} B)")
    bottom.set_xlabel("seconds since the traffic started")
    top.set_title(f"Donor capacity over time, SwiftCache run (CPU). busy "
                  f"{facts['busy'].flops_per_kv_byte / 1e3:.1f} kFLOP/KV byte, donor "
                  f"{facts['donor'].flops_per_kv_byte / 1e3:.1f} kFLOP/KV byte", fontsize=9)
    for ax in (top, bottom):
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
