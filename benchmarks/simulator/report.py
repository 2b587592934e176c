"""Markdown tables and PNG plots of simulator results; every title says SIMULATED."""

from __future__ import annotations

from pathlib import Path

from benchmarks.loadgen import plots

from .params import assumptions_table


def _s(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def sweep_table(sweep: list[dict]) -> str:
    systems = list(dict.fromkeys(r["system"] for r in sweep))
    by = {(r["system"], r["rate"]): r["master"] for r in sweep}
    head = ("| rate (sessions/s) | " + " | ".join(f"{s} P99 TTFT (s)" for s in systems)
            + " | SwiftCache hit dev/donor/host | stable (hicache, swift) |")
    lines = [head, "|" + "---|" * (len(systems) + 3)]
    for rate in sorted({r["rate"] for r in sweep}):
        cells = [_s(by[(s, rate)]["ttft_p99"]) if (s, rate) in by else "-" for s in systems]
        sw = by.get(("swiftcache", rate), {})
        h = sw.get("hit_rate", {})
        hit = "/".join(f"{h.get(t, 0):.2f}" for t in ("device", "donor", "host"))
        st = f"{by.get(('sglang-hicache', rate), {}).get('stable')}, {sw.get('stable')}"
        lines.append(f"| {rate} | " + " | ".join(cells) + f" | {hit} | {st} |")
    return "\n".join(lines)


def reduction_table(rows: list[dict]) -> str:
    lines = ["| rate | HiCache P99 TTFT (s) | SwiftCache P99 TTFT (s) | reduction | both stable |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate']} | {r['base_p99']:.3f} | {r['ours_p99']:.3f} | "
                     f"{r['reduction']:.1%} | {r['stable_base'] and r['stable_ours']} |")
    return "\n".join(lines)


def comparison_table(comparisons: dict) -> str:
    """Goodput and P99 TTFT at the baseline's highest sustained rate, with memory per tier."""
    lines = ["| comparison | baseline | memory GB (device/donor/host): SwiftCache; baseline "
             "| SLO P99 TTFT (s) | goodput SwiftCache / baseline (sessions/s) | goodput ratio "
             "| stable rate | P99 TTFT there (s): SwiftCache / baseline | reduction |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, c in comparisons.items():
        base = c["baseline"]
        mem = "; ".join("/".join(f"{c['memory_gb'][s][t]:.1f}" for t in ("device", "donor", "host"))
                        for s in ("swiftcache", base))
        g = c["goodput_sessions_per_s"]
        low = {s: (">=" if c["goodput_is_lower_bound"][s] else "") for s in g}
        p = c["p99_ttft_s_at_stable_rate"]
        lines.append(f"| {name} | {base} | {mem} | {c['slo_p99_ttft_s']:.2f} | "
                     f"{low['swiftcache']}{g['swiftcache']:.3f} / {low[base]}{g[base]:.3f} | "
                     f"{_s(c['goodput_ratio_vs_hicache'], '{:.2f}x')} | "
                     f"{c['stable_rate_sessions_per_s']:.3f} | "
                     f"{_s(p['swiftcache'])} / {_s(p[base])} | "
                     f"{_s(c['p99_ttft_reduction_at_stable'], '{:.1%}')} |")
    by_f = {name: c.get("goodput_ratio_vs_hicache_by_slo_factor", {})
            for name, c in comparisons.items()}
    factors = sorted({f for d in by_f.values() for f in d}, key=float)
    if len(factors) > 1:
        lines += ["", "| SLO factor | " + " | ".join(f"goodput ratio, {n}" for n in by_f) + " |",
                  "|---|" + "---|" * len(by_f)]
        for f in factors:
            lines.append(f"| {f} | " + " | ".join(_s(d.get(f), "{:.2f}x") for d in by_f.values())
                         + " |")
    return "\n".join(lines)


def donor_goodput_table(scn, rates, slos) -> str:
    lines = ["| donor | model | SLO P99 TTFT (s) | goodput alone (chat sessions/s) |",
             "|---|---|---|---|"]
    for i, (g, slo) in enumerate(zip(rates, slos)):
        lines.append(f"| donor{i + 1} | {scn.donors[i]} | {slo:.3f} | {g:.3g} |")
    return "\n".join(lines)


def interference_table(rows: list[dict]) -> str:
    """Per donor load share: each donor's P99 TTFT and TPOT alone and while lending."""
    lines = ["| donor load (share of own goodput) | donor | rate (sessions/s) "
             "| P99 TTFT alone (s) | P99 TTFT lending (s) | change | P99 TPOT alone (ms) "
             "| P99 TPOT lending (ms) | change |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for d in r["donors"]:
            lines.append(f"| {r['share']:.0%} | {d['donor']} | {d['rate']:.3g} | "
                         f"{d['ttft_p99_alone']:.3f} | {d['ttft_p99_lending']:.3f} | "
                         f"{d['ttft_change']:+.1%} | {d['tpot_p99_alone'] * 1e3:.2f} | "
                         f"{d['tpot_p99_lending'] * 1e3:.2f} | {d['tpot_change']:+.1%} |")
    lines += ["", "| donor load | master rate (sessions/s) | lent blocks | reclaimed "
              "| master donor hit | master P99 TTFT (s) | master stable | failed loads |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['share']:.0%} | {r['master_rate']:.3f} | {r['lent_blocks']} | "
                     f"{r['reclaimed_blocks']} | {r['master_donor_hit']:.2f} | "
                     f"{r['master_ttft_p99']:.3f} | {r['master_stable']} | "
                     f"{r['master_load_failures']} |")
    return "\n".join(lines)


def capacity_md(cap: dict) -> str:
    d = cap["default"]
    lines = ["| system | max context (tokens) |", "|---|---|"]
    for k, v in d["max_tokens"].items():
        lines.append(f"| {k} | {v:,} |")
    m = d["at_max"]
    lines.append(f"\nratio {d['ratio']:.2f}x (stepwise streaming sweep, depth {d['depth']}: "
                 f"local KV {d['local_kv_gb']:.1f} GB, leased {d['lent_gb']:.1f} GB at lend "
                 f"fraction {d['lend_fraction']}, host {d['host_gb']:.1f} GB).")
    if m:
        lines.append(f"At {m['context']:,} tokens a streamed decode step takes "
                     f"{m['decode_step_s'] * 1e3:.0f} ms against "
                     f"{m['decode_step_resident_s'] * 1e3:.0f} ms resident "
                     f"(x{m['decode_slowdown']:.1f}); TTFT x{m['prefill_slowdown']:.3f}.")
    lines.append("\n| lend fraction | leased GB | max context ratio |\n|---|---|---|")
    for s in cap["sensitivity"]:
        lines.append(f"| {s['lend_fraction']} | {s['lent_gb']:.1f} | {s['ratio']:.2f}x |")
    return "\n".join(lines)


def assumptions_md() -> str:
    lines = ["| parameter | value | unit | source |", "|---|---|---|---|"]
    for name, val, unit, src in assumptions_table():
        lines.append(f"| {name} | {val} | {unit} | {src} |")
    return "\n".join(lines)


def sweep_plot(sweep: list[dict], path: Path, title: str) -> Path:
    curves: dict = {}
    for r in sweep:
        curves.setdefault(r["system"], []).append((r["rate"], r["master"]["ttft_p99"]))
    return plots.p99_vs_rate(curves, path, title=f"SIMULATED: {title}", logy=True)
