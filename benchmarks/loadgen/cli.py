"""`bench_sessions`: replay chat or agent sessions against one or more servers; tables, JSON, PNG.

Examples:
  scripts/bench_sessions.py --server off=http://127.0.0.1:30000 --server on=http://127.0.0.1:30001
  scripts/bench_sessions.py --quick --launch        # starts the CPU demo servers (off and on)
  scripts/bench_sessions.py --quick --launch --workload agent-frontend   # SGLang frontend programs

Workloads: chat (ShareGPT conversations), agent (tool loops as raw prompts), agent-frontend (the
same tool loops written in SGLang's frontend language, sgl.function with fork for parallel tool
calls, run through sgl.RuntimeEndpoint; it reports program latency instead of TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..workloads.frontend_programs import agent_programs
from ..workloads.specs import AgentWorkload, ChatWorkload
from ..workloads.text_sessions import agent_sessions, chat_sessions
from . import frontend, plots, runner, stats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_sessions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", action="append", default=[], metavar="LABEL=URL",
                   help="server to test; give two to print ratios (second / first)")
    p.add_argument("--launch", action="store_true",
                   help="start the CPU demo servers (the tiny model, SwiftCache off then on; "
                        "tools/local_server.py)")
    p.add_argument("--workload", choices=["chat", "agent", "agent-frontend"], default="chat")
    p.add_argument("--fanout", type=int, default=2,
                   help="agent-frontend: parallel tool calls per step (one fork each)")
    p.add_argument("--chat-template", default=None,
                   help="agent-frontend: SGLang chat template name (default: chosen from the "
                        "model path)")
    p.add_argument("--api", choices=["generate", "chat"], default="generate")
    p.add_argument("--model", default="default", help="model name for /v1/chat/completions")
    p.add_argument("--rates", default="1.0", help="comma-separated session arrival rates (1/s)")
    p.add_argument("--num-sessions", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-chars", type=int, default=2000, help="clip each ShareGPT message")
    p.add_argument("--think-mean", type=float, default=2.0, help="mean think/tool time (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-flush", action="store_true", help="don't POST /flush_cache between runs")
    p.add_argument("--no-warmup", action="store_true", help="don't send one untimed request first")
    p.add_argument("--quick", action="store_true",
                   help="small workload that ends in < 1 min on CPU")
    p.add_argument("--out", default=None, help="output directory (default runs/bench-<time>)")
    return p


def _apply_quick(a: argparse.Namespace) -> None:
    a.num_sessions, a.max_turns, a.max_tokens = 4, 3, 8
    a.max_chars, a.think_mean = 300, 0.2
    if a.rates == "1.0":
        a.rates = "2.0"


def make_sessions(a: argparse.Namespace):
    if a.workload == "chat":
        chat = ChatWorkload(max_turns=a.max_turns, min_turns=2, max_chars_per_message=a.max_chars,
                            max_output_tokens=a.max_tokens, think_mean_s=a.think_mean, seed=a.seed)
        return chat_sessions(chat, a.num_sessions)
    return agent_sessions(agent_workload(a), a.num_sessions)


def agent_workload(a: argparse.Namespace) -> AgentWorkload:
    # every answer a.max_tokens long; each session has its own system prompt (no prefix shared
    # across sessions)
    agent = AgentWorkload(output_min=a.max_tokens, output_max=a.max_tokens,
                          tool_latency_mean_s=a.think_mean, shared_system_prompt=False, seed=a.seed)
    if a.quick:
        agent = replace(agent, system_min=100, system_max=200, steps_min=3, steps_max=a.max_turns,
                        tool_median=60, tool_min=20, tool_max=200)
    return agent


def _launch_specs():
    """The CPU demo servers: the tiny model with SwiftCache off, then on."""
    from benchmarks.tools.local_server import LocalServer
    from benchmarks.tools.tiny_model import DEFAULT_DIR, ensure_tiny_model

    model = ensure_tiny_model(DEFAULT_DIR, seed=0)
    for label, on in (("swiftcache-off", False), ("swiftcache-on", True)):
        yield label, LocalServer(model, swiftcache=on, extra_args=["--enable-cache-report"])


def _one_run(a: argparse.Namespace, work, url: str, label: str, rate: float,
             bar) -> tuple[dict, list]:
    """One server at one rate: the summary and the records (requests, or agent programs)."""
    if a.workload == "agent-frontend":
        recs = frontend.run_programs(url, label, work, rate, seed=a.seed,
                                     chat_template=a.chat_template, progress=bar)
        return frontend.summarize(recs), recs
    recs = asyncio.run(runner.run_sessions(url, label, work, rate, api=a.api, seed=a.seed,
                                           progress=bar, model=a.model))
    return stats.summarize(recs), recs


def run(a: argparse.Namespace, servers: dict[str, str]) -> dict:
    from tqdm import tqdm

    if a.workload == "agent-frontend":
        work = agent_programs(agent_workload(a), a.num_sessions, a.fanout)
        per_run = len(work)
    else:
        work = make_sessions(a)
        per_run = sum(len(s.turns) for s in work)
    rates = [float(x) for x in a.rates.split(",") if x]
    total = per_run * len(rates) * len(servers)
    results: dict = {"config": {k: v for k, v in vars(a).items() if k != "server"},
                     "servers": servers, "runs": []}
    unit = "program" if a.workload == "agent-frontend" else "req"
    with tqdm(total=total, desc=f"{unit}s", unit=unit, file=sys.stderr) as bar:
        for rate in rates:
            for label, url in servers.items():
                if not a.no_flush:
                    asyncio.run(runner.flush(url))
                if not a.no_warmup:  # one untimed request, so neither server is measured cold
                    asyncio.run(runner.warmup(url, a.api, a.model))
                t0 = time.perf_counter()
                s, recs = _one_run(a, work, url, label, rate, bar)
                s["wall_s"] = time.perf_counter() - t0
                results["runs"].append({"server": label, "rate": rate, "summary": s,
                                        "records": [r.to_json() for r in recs]})
    return results


def report(results: dict, out: Path) -> list[str]:
    if results["config"]["workload"] == "agent-frontend":
        return report_programs(results, out)
    labels = list(results["servers"])
    lines = []
    for run_ in results["runs"]:
        lines.append(stats.format_summary(f"{run_['server']} @ {run_['rate']}/s", run_["summary"]))
    if len(labels) >= 2:
        base, other = labels[0], labels[1]
        for rate in sorted({r["rate"] for r in results["runs"]}):
            by = {r["server"]: r["summary"] for r in results["runs"] if r["rate"] == rate}
            rat = stats.ratios(by[base], by[other])
            results.setdefault("ratios", {})[str(rate)] = rat
            lines.append(f"== ratios {other}/{base} @ {rate}/s: " + ", ".join(
                f"{k} {v:.2f}" for k, v in rat.items() if v is not None))
    top = max(r["rate"] for r in results["runs"])
    cdf = {r["server"]: [x["ttft"] for x in r["records"]]
           for r in results["runs"] if r["rate"] == top}
    curves = {lab: [(r["rate"], r["summary"]["ttft_p99"])
                    for r in results["runs"] if r["server"] == lab]
              for lab in labels}
    turns = {r["server"]: r["summary"]["per_turn"] for r in results["runs"] if r["rate"] == top}
    pngs = [plots.ttft_cdf(cdf, out / "ttft_cdf.png"),
            plots.p99_vs_rate(curves, out / "p99_ttft_vs_rate.png"),
            plots.per_turn_ttft(turns, out / "ttft_per_turn.png")]
    lines.append("plots: " + ", ".join(str(p) for p in pngs))
    return lines


def report_programs(results: dict, out: Path) -> list[str]:
    """Agent-program runs: latency tables, second/first latency ratios, identical outputs, a
    plot."""
    labels = list(results["servers"])
    lines = [frontend.format_summary(f"{r['server']} @ {r['rate']}/s", r["summary"])
             for r in results["runs"]]
    if len(labels) >= 2:
        base, other = labels[0], labels[1]
        for rate in sorted({r["rate"] for r in results["runs"]}):
            by = {r["server"]: r for r in results["runs"] if r["rate"] == rate}
            rat = {f"latency_p{q}": (by[other]["summary"][f"latency_p{q}"]
                                     / by[base]["summary"][f"latency_p{q}"]
                                     if by[base]["summary"][f"latency_p{q}"] else None)
                   for q in (50, 90, 99)}
            same = ([x["outputs"] for x in by[base]["records"]]
                    == [x["outputs"] for x in by[other]["records"]])
            results.setdefault("ratios", {})[str(rate)] = dict(rat, identical_outputs=same)
            lines.append(f"== ratios {other}/{base} @ {rate}/s: "
                         + ", ".join(f"{k} {v:.2f}" for k, v in rat.items() if v is not None)
                         + f"; identical greedy outputs: {same}")
    curves = {lab: [(r["rate"], r["summary"]["latency_p99"])
                    for r in results["runs"] if r["server"] == lab]
              for lab in labels}
    png = plots.p99_vs_rate(curves, out / "p99_program_latency_vs_rate.png",
                            title="P99 agent-program latency vs rate",
                            ylabel="P99 program latency (ms)")
    lines.append(f"plots: {png}")
    return lines


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.quick:
        _apply_quick(a)
    out = Path(a.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    servers = dict(s.split("=", 1) for s in a.server)
    if a.launch:
        # one server at a time, so they don't compete for the CPU cores while measured
        results = None
        for label, server in _launch_specs():
            with server:
                part = run(a, {label: server.base_url})
            if results is None:
                results = part
            else:
                results["servers"].update(part["servers"])
                results["runs"].extend(part["runs"])
        if servers:
            part = run(a, servers)
            results["servers"].update(part["servers"])
            results["runs"].extend(part["runs"])
    elif servers:
        results = run(a, servers)
    else:
        raise SystemExit("give --server LABEL=URL (one or more) or --launch")
    lines = report(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n".join(lines))
    print(f"results: {out / 'results.json'}")
    return 0 if all(r["summary"]["errors"] == 0 for r in results["runs"]) else 1
