"""One run of the hierarchy benchmark: its two servers start side by side, the busy server
replays the conversations turn by turn (one request at a time, conversations interleaved, so a
history is pushed out of the device by the others before its next turn), the donor's own burst
comes after `burst_after_turn` turns, and the remaining turns follow. The busy server's
`/metrics` is read at the end (SwiftCache's counters of hits and copies by tier)."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..loadgen.client import RequestRecord, chat
from ..nodebench.observe import parse_metrics
from ..tools.demo import wait_for_lease
from ..tools.local_server import LocalServer, start_all
from .plan import Server

TIER_METRICS = ("swiftcache_donor_hit_tokens_total", "swiftcache_host_hit_tokens_total",
                "swiftcache_rescued_tokens_total", "swiftcache_spilled_tokens_total",
                "swiftcache_donor_to_host_tokens_total", "swiftcache_donor_to_l3_tokens_total",
                "swiftcache_revoked_tokens_total", "swiftcache_reclaim_overflow_tokens_total",
                "swiftcache_recomputed_after_reclaim_tokens_total",
                "swiftcache_reclaims_total", "swiftcache_loads_failed_total",
                "swiftcache_host_stored_tokens_total", "swiftcache_stored_tokens_total",
                "swiftcache_borrowed_tokens", "swiftcache_host_capacity_tokens",
                "swiftcache_l3_fetched_tokens_total", "swiftcache_l3_written_pages_total")
RECLAIM_WAIT_S = 60.0


@dataclass
class RunResult:
    run: str
    records: list[RequestRecord]
    burst: list[RequestRecord]
    metrics: dict[str, float]
    startup_s: dict[str, float]
    wall_s: float
    loadavg: tuple
    pools: dict[str, int] = field(default_factory=dict)
    relent_before_resume: bool | None = None  # (s): donor memory back when the turns resumed


def _metrics(server: LocalServer) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode(errors="replace"), TIER_METRICS)


def _wait_metric(server: LocalServer, name: str, at_least: float, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    value = 0.0
    while time.monotonic() < deadline:
        value = _metrics(server).get(name, 0.0)
        if value >= at_least:
            return value
        time.sleep(0.3)  # polling another process's counters
    raise RuntimeError(f"{name} stayed at {value} (< {at_least}) for {timeout_s:.0f}s")


async def _turns(http, url: str, convs, histories, first: int, last: int, plan, forced, out,
                 t0: float) -> None:
    for t in range(first, last):
        for conv, msgs in zip(convs, histories):
            if t >= len(conv.turns):
                continue
            msgs.append({"role": "user", "content": conv.turns[t].user})
            rec = RequestRecord(session=conv.id, turn=t + 1, server="busy", t_send=0.0)
            await chat(http, url, list(msgs), plan.max_tokens, rec, t0)
            if rec.error:
                raise RuntimeError(f"busy request {conv.id} turn {t + 1} failed: {rec.error}")
            out.append(rec)
            answer = forced[(conv.id, t + 1)] if forced is not None else rec.text
            msgs.append({"role": "assistant", "content": answer})


async def _burst(http, url: str, plan, t0: float) -> list[RequestRecord]:
    prompt = " ".join(f"word{i}" for i in range(plan.burst_words))
    recs = [RequestRecord(session=f"burst-{i}", turn=1, server="donor", t_send=0.0)
            for i in range(plan.burst_requests)]
    await asyncio.gather(*(chat(http, url, [{"role": "user", "content": f"{i} {prompt}"}],
                                plan.burst_max_tokens, rec, t0) for i, rec in enumerate(recs)))
    bad = [r.error for r in recs if r.error]
    if bad:
        raise RuntimeError(f"donor burst request failed: {bad[0]}")
    return recs


def run_one(run: str, spec: dict[str, Server], plan, convs, forced, out_dir: Path,
            rendezvous: str) -> RunResult:
    import aiohttp

    before = os.getloadavg()
    t_start = time.monotonic()
    servers = {role: LocalServer(s.model, swiftcache=s.swiftcache, max_total_tokens=s.pool,
                                 extra_args=list(s.args),
                                 log_path=out_dir / f"{run}-{role}.log")
               for role, s in spec.items()}
    try:
        start_all(servers.values())
        busy, donor = servers["busy"], servers["donor"]
        if spec["busy"].swiftcache:
            wait_for_lease(rendezvous, timeout_s=180)
            _wait_metric(busy, "swiftcache_borrowed_tokens", 1, 60)

        async def traffic():
            records: list[RequestRecord] = []
            histories = [[] for _ in convs]
            t0 = time.perf_counter()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
                await _turns(http, busy.base_url, convs, histories, 0, plan.burst_after_turn,
                             plan, forced, records, t0)
                burst = await _burst(http, donor.base_url, plan, t0)
                if spec["busy"].swiftcache:  # every lent page back before the turns go on
                    _wait_metric(busy, "swiftcache_reclaims_total", 1, RECLAIM_WAIT_S)
                await asyncio.sleep(plan.pause_after_burst_s)  # the think time, every run
                relent = (_metrics(busy).get("swiftcache_borrowed_tokens", 0) > 0
                          if spec["busy"].swiftcache else None)  # donor memory back in time?
                await _turns(http, busy.base_url, convs, histories, plan.burst_after_turn,
                             plan.turns, plan, forced, records, t0)
            return records, burst, relent

        records, burst, relent = asyncio.run(traffic())
        metrics = _metrics(busy) if spec["busy"].swiftcache else {}
        startup = {role: s.startup_s for role, s in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    return RunResult(run, records, burst, metrics, startup, time.monotonic() - t_start,
                     (before, os.getloadavg()), {role: s.pool for role, s in spec.items()},
                     relent)
