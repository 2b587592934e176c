"""Markdown tables and PNG plots of simulator results; every title says SIMULATED."""

from __future__ import annotations

from pathlib import Path

from sglang_swift.loadgen import plots

from .params import assumptions_table


def _s(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def sweep_table(sweep: list[dict]) -> str:
    systems = list(dict.fromkeys(r["system"] for r in sweep))
    by = {(r["system"], r["rate"]): r["master"] for r in sweep}
    head = "| rate (sessions/s) | " + " | ".join(f"{s} P99 TTFT (s)" for s in systems) + " | SwiftCache hit dev/donor/host | stable (hicache, swift) |"
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
        lines.append(f"| {r['rate']} | {r['base_p99']:.3f} | {r['ours_p99']:.3f} | {r['reduction']:.1%} | "
                     f"{r['stable_base'] and r['stable_ours']} |")
    return "\n".join(lines)


def interference_table(rows: list[dict]) -> str:
    lines = ["| master rate | donor | P99 TTFT alone (s) | P99 TTFT lending (s) | change | P99 TPOT alone (ms) | P99 TPOT lending (ms) | change |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate']} | {r['donor']} | {r['ttft_p99_alone']:.3f} | {r['ttft_p99_lending']:.3f} | "
                     f"{r['ttft_change']:+.1%} | {r['tpot_p99_alone'] * 1e3:.2f} | {r['tpot_p99_lending'] * 1e3:.2f} | "
                     f"{r['tpot_change']:+.1%} |")
    return "\n".join(lines)


def busy_table(rows: list[dict]) -> str:
    lines = ["| donor rate (sessions/s each) | HiCache P99 (s) | SwiftCache P99 (s) | reduction | lent blocks | reclaimed | donor hit | failed loads | donor interference |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['donor_rate']} | {r['hicache_p99']:.3f} | {r['swift_p99']:.3f} | {r['reduction']:.1%} | "
                     f"{r['lent_blocks']} | {r['reclaimed_blocks']} | {r['donor_hit']:.2f} | {r['load_failures']} | "
                     f"{r['donor_interference']:+.1%} |")
    return "\n".join(lines)


def capacity_md(cap: dict) -> str:
    d = cap["default"]
    lines = ["| system | max context (tokens) |", "|---|---|"]
    for k, v in d["max_tokens"].items():
        lines.append(f"| {k} | {v:,} |")
    lines.append(f"\nratio {d['ratio']:.2f}x (local KV {d['local_kv_gb']:.1f} GB, leased {d['lent_gb']:.1f} GB at "
                 f"lend fraction {d['lend_fraction']}); at that length SwiftCache keeps "
                 f"{d['swiftcache_resident_layers']} layers resident and its decode TPOT is "
                 f"{d['tpot_at_max_s']['swiftcache'] * 1e3:.0f} ms (NVLink-bound) vs "
                 f"{d['tpot_at_max_s']['baseline'] * 1e3:.0f} ms for a baseline at its own maximum.")
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
