"""How much the donor's burst TTFT moves with nothing changed (scripts/burst_noise.py).

    python scripts/burst_noise.py [--servers 3] [--rounds 8] [--sequential]

Stock SGLang only: `--servers` identical donor servers (the node benchmark's `tiny` model, pool
and burst, each warmed as `warm_up_donor` warms it). Side by side (the default), all of them
stay up and each round sends the burst to each in turn (order rotated per round), every cache
flushed between rounds: the node benchmark's round structure. With `--sequential`, one server
at a time serves all its rounds, then stops before the next starts: one burst series per
process, minutes apart, as one run after another saw it. Prints each server's burst TTFTs
(slowest request of each burst, ms), their max and median, and the ratio of each server's max
to the first's: identical servers, so every ratio away from 1 is noise, the floor under any
P99 ratio the node benchmark reports. Last line: a JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

from ..loadgen.client import RequestRecord, generate_batch
from ..tools.local_server import LocalServer
from ..tools.tiny_model import ensure_tiny_model
from .plan import COMMON_ARGS, NodePlan
from .runner import MALLOC_KEEPS_MEMORY
from .traffic import Traffic, build_traffic, flush_donors, round_order, session, warm_up_donor


async def _burst_ms(http, url: str, traffic: Traffic, plan: NodePlan) -> float:
    recs = [RequestRecord(session=f"burst-{i}", turn=1, server="burst", t_send=0.0)
            for i in range(len(traffic.burst))]
    await generate_batch(http, url, [list(ids) for ids in traffic.burst], plan.burst_max_tokens,
                         recs, time.perf_counter())
    if any(r.error or r.ttft is None for r in recs):
        raise RuntimeError(f"{url}: a burst request failed: {[r.error for r in recs]}")
    return round(1e3 * max(r.ttft for r in recs), 1)


def _rounds(urls: dict[str, str], traffic: Traffic, plan: NodePlan,
            rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in urls}
    for r in range(rounds):
        async def one(r=r):
            async with session() as http:
                for key in round_order(list(urls), r):
                    out[key].append(await _burst_ms(http, urls[key], traffic, plan))
        asyncio.run(one())
        asyncio.run(flush_donors(list(urls.values())))
    return out


def _server(model: Path, plan: NodePlan, log: Path) -> LocalServer:
    env = {**os.environ, "OMP_NUM_THREADS": str(plan.server_threads), **MALLOC_KEEPS_MEMORY}
    return LocalServer(model, swiftcache=False, max_total_tokens=plan.donor_pool,
                       extra_args=list(COMMON_ARGS), log_path=log, env=env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--sequential", action="store_true",
                    help="one server at a time, all its rounds, then the next")
    ap.add_argument("--out", type=Path, default=Path("runs/burst_noise"))
    args = ap.parse_args(argv)
    if args.servers < 1 or args.rounds < 1:
        ap.error("--servers and --rounds must be at least 1")
    plan = NodePlan.quick()
    model = ensure_tiny_model(shape="tiny")
    traffic = build_traffic(plan, model / "tokenizer.json")
    args.out.mkdir(parents=True, exist_ok=True)
    keys = [f"s{i}" for i in range(args.servers)]
    started = time.monotonic()
    bursts: dict[str, list[float]] = {}
    with ExitStack() as stack:
        urls = {}
        for key in keys:
            server = _server(model, plan, args.out / f"{key}.log")
            if args.sequential:
                with server:
                    warm_up_donor(server.base_url, traffic)
                    bursts.update(_rounds({key: server.base_url}, traffic, plan, args.rounds))
                continue
            stack.enter_context(server)
            warm_up_donor(server.base_url, traffic)
            urls[key] = server.base_url
        if urls:
            bursts = _rounds(urls, traffic, plan, args.rounds)
    first = max(bursts[keys[0]])
    summary = {"mode": "sequential" if args.sequential else "side by side",
               "servers": args.servers, "rounds": args.rounds, "bursts_ms": bursts,
               "max_ms": {k: max(v) for k, v in bursts.items()},
               "median_ms": {k: statistics.median(v) for k, v in bursts.items()},
               "max_ratio_to_first": {k: round(max(v) / first, 3) for k, v in bursts.items()},
               "wall_s": round(time.monotonic() - started),
               "loadavg_1min": round(os.getloadavg()[0], 2)}
    for key in keys:
        print(f"{key}: bursts {bursts[key]} ms; max {summary['max_ms'][key]}, median "
              f"{summary['median_ms'][key]}, max / {keys[0]}'s max "
              f"{summary['max_ratio_to_first'][key]}")
    print(json.dumps(summary))
    return 0
