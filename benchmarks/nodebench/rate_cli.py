"""P99 TTFT against request rate for the busy model of the node benchmark (scripts/bench_rate.py).

    python scripts/bench_rate.py [--quick] [--systems stock,swiftcache,ideal] [--rates 0.5,1]
                                 [--out runs/rate_curves] [--plot PNG] [--replot]

Per system (stock SGLang, SwiftCache, the capacity-equal ideal; `hicache` tries SGLang's
HiCache), the node benchmark's two servers; all start once, side by side, and the systems take
turns at each rate (rate_driver.running_nodes), the busy server's cache flushed before each
point. Each rate replays multi-turn ShareGPT sessions arriving as a Poisson process (rates.py
says how a point is judged). Prints a table per point, writes the plot and every request to OUT,
and prints last a JSON object: per system, per rate, p50 and p99 TTFT (ms), completed requests,
stable and drained, the highest rate sustained, and the systems that did not start, with why.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import time
from dataclasses import replace
from pathlib import Path

from ..tools.tiny_model import ensure_tiny_model
from .plan import ModelFacts, NodePlan
from .rate_driver import build_node, run_point, running_nodes
from .rates import PointResult, RatePlan, build_sessions, summary_json

ERROR_LINE = re.compile(r"^(\w+\.)*\w*(Error|Exception)\b.*")
STYLE = {"stock": "tab:gray", "swiftcache": "tab:blue", "ideal": "tab:green",
         "hicache": "tab:orange"}


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, RatePlan]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"rates {RatePlan.quick().rates}, {RatePlan.quick().window_s:.0f} s "
                         f"windows, {RatePlan.quick().turns} turns, stock and swiftcache only")
    ap.add_argument("--rates", type=_floats, default=None, help="sessions/s, comma-separated")
    ap.add_argument("--systems", type=lambda s: tuple(s.split(",")), default=None,
                    help="comma-separated, of stock, swiftcache, ideal, hicache")
    for name in ("window_s", "drain_s", "think_mean_s"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=None,
                        help=f"default {getattr(RatePlan(), name)}, --quick "
                             f"{getattr(RatePlan.quick(), name)}")
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("runs/rate_curves"),
                    help="server logs and rate_curves.json (every request) go here")
    ap.add_argument("--plot", type=Path, default=None, help="default: OUT/rate_curves.png")
    ap.add_argument("--replot", action="store_true",
                    help="start nothing: redraw the plot from OUT/rate_curves.json")
    args = ap.parse_args(argv)
    plan = RatePlan.quick() if args.quick else RatePlan()
    overrides = {k: getattr(args, k) for k in ("rates", "systems", "window_s", "drain_s",
                                               "think_mean_s", "turns", "seed")
                 if getattr(args, k) is not None}
    try:
        plan = replace(plan, **overrides)
    except ValueError as exc:
        ap.error(str(exc))
    return args, plan


def last_error_line(log_text: str) -> str:
    """The last `SomethingError: ...` line of a server log (what stopped it), or its last line."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ERROR_LINE.match(ln)]
    return errors[-1] if errors else (lines[-1] if lines else "(empty log)")


def format_point(p: PointResult) -> str:
    hit = f"{p.cached_tokens / p.prompt_tokens:.0%}" if p.prompt_tokens else "-"
    num = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    return (f"{p.system:<11}{p.rate:>6.2f}{p.sessions:>5}{p.sent:>6}{p.completed:>6}"
            f"{p.unanswered:>5}{p.errors:>5}{num(p.ttft_p50_ms):>9}{num(p.ttft_p99_ms):>9}"
            f"{hit:>6}{p.queue_q2:>6.1f}{p.queue_q4:>6.1f}{str(p.stable):>7}{str(p.drained):>8}"
            f"{p.extra.get('loadavg_1min', [0, 0])[1]:>6.1f}")


HEADER = (f"{'system':<11}{'rate':>6}{'sess':>5}{'sent':>6}{'done':>6}{'cut':>5}{'err':>5}"
          f"{'p50 ms':>9}{'p99 ms':>9}{'hit':>6}{'q2':>6}{'q4':>6}{'stable':>7}{'drained':>8}"
          f"{'load':>6}")


def plot_curves(path: Path, points: list[PointResult], title: str) -> None:
    """Top: P99 (solid) and P50 (dashed) TTFT against the session rate per system; a point not
    sustained (queue grew, or not drained) is drawn hollow. Bottom: the machine's 1-minute load
    average when each point ended (a shared machine: read the top panel against it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, load_ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    for system in dict.fromkeys(p.system for p in points):
        pts = sorted((p for p in points if p.system == system and p.ttft_p99_ms is not None),
                     key=lambda p: p.rate)
        color = STYLE.get(system)
        for key, style, label in (("ttft_p99_ms", "-", "P99"), ("ttft_p50_ms", "--", "P50")):
            xs, ys = [p.rate for p in pts], [getattr(p, key) for p in pts]
            ax.plot(xs, ys, style, color=color, label=f"{system} {label}")
            for p, y in zip(pts, ys):
                solid = p.stable and p.drained
                ax.plot([p.rate], [y], "o", color=color,
                        markerfacecolor=color if solid else "white")
        load_ax.plot([p.rate for p in pts],
                     [p.extra.get("loadavg_1min", [None, None])[1] for p in pts], "o-",
                     color=color, label=system)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms), client-measured")
    ax.set_title(title, fontsize=9)
    load_ax.set_xlabel("session arrival rate (sessions/s)")
    load_ax.set_ylabel("load avg (1 min)\n2 cores", fontsize=8)
    for a in (ax, load_ax):
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_title(busy_name: str, date: str) -> str:
    return (f"Busy model ({busy_name}): TTFT vs session rate, live CPU, {date} "
            f"(hollow: not sustained)")


def replot(out: Path, plot: Path) -> int:
    """Redraw the plot of an earlier sweep from its rate_curves.json."""
    detail = json.loads((out / "rate_curves.json").read_text())
    names = set(PointResult.__dataclass_fields__)
    points = [PointResult(**{k: v for k, v in p.items() if k in names})
              for p in detail["points"]]
    plot_curves(plot, points, plot_title(detail.get("busy_model", "small-llama"),
                                         detail["summary"]["date"]))
    print(f"plot: {plot}")
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds the context managers, so the servers are stopped


def main(argv: list[str] | None = None) -> int:
    args, plan = parse_args(argv)
    if args.replot:
        return replot(args.out, args.plot or args.out / "rate_curves.png")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started, load_start = time.monotonic(), os.getloadavg()
    node = NodePlan()
    busy_model, donor_model = ensure_tiny_model(shape="small"), ensure_tiny_model(shape="tiny")
    facts = {"busy": ModelFacts.from_dir(busy_model), "donor": ModelFacts.from_dir(donor_model)}
    sessions = build_sessions(plan, node, plan.max_sessions())
    print(f"busy: {facts['busy'].describe()}; pool {node.busy_pool} tokens; donor: pool "
          f"{node.donor_pool} tokens, lends {node.lend_fraction:.0%} (= "
          f"{node.lendable_busy_tokens(facts['busy'], facts['donor'])} busy tokens), idle")
    print(f"sessions: ShareGPT, {plan.turns} turns, think Exp({plan.think_mean_s} s), "
          f"{node.max_tokens} output tokens; rates {plan.rates} sessions/s over "
          f"{plan.window_s:.0f} s windows (+{plan.drain_s:.0f} s drain); systems {plan.systems}",
          flush=True)
    points: list[PointResult] = []
    nodes = [build_node(system, node, busy_model, donor_model, facts, args.out)
             for system in plan.systems]
    print(f"starting {len(nodes) * 2} servers side by side ...", flush=True)
    with running_nodes(nodes) as up:
        for n in up:
            print(f"[{n.system}] pools {n.pools}, start-up {n.startup_s()}, lease wait "
                  f"{n.lease_wait_s:.1f}s", flush=True)
        print(HEADER, flush=True)
        for i, rate in enumerate(plan.rates):
            # the systems take turns at each rate, in alternating order, so neither always
            # runs right after the other's overload
            for n in (up if i % 2 == 0 else up[::-1]):
                point = run_point(n, plan, node, rate, sessions)
                points.append(point)
                print(format_point(point), flush=True)
        servers = {n.system: {"pools": n.pools, "startup_s": n.startup_s(),
                              "lease_wait_s": round(n.lease_wait_s, 1), "alerts": n.alerts()}
                   for n in up}
    failures = {n.system: last_error_line(n.busy.log_text()) for n in nodes if n.error}
    for system, line in failures.items():
        print(f"[{system}] did not start: {line} (log: {args.out / f'{system}-busy.log'})")

    plot = args.plot or args.out / "rate_curves.png"
    if points:
        plot_curves(plot, points, plot_title(facts["busy"].name,
                                             datetime.date.today().isoformat()))
    summary = summary_json(points, failures)
    summary.update(date=datetime.date.today().isoformat(), quick=args.quick,
                   wall_s=round(time.monotonic() - started),
                   loadavg_1min=[round(load_start[0], 2), round(os.getloadavg()[0], 2)],
                   device=f"CPU only ({os.cpu_count()} cores)")
    args.out.mkdir(parents=True, exist_ok=True)
    detail = {"summary": summary, "plan": plan.__dict__, "servers": servers,
              "busy_model": facts["busy"].name,
              "points": [p.to_json() for p in points]}
    (args.out / "rate_curves.json").write_text(json.dumps(detail, indent=1, default=str))
    print(f"plot: {plot if points else '(none)'}; details: {args.out / 'rate_curves.json'}")
    print(json.dumps(summary))
    return 0 if points else 1
