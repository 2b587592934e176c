"""The live side of the rate sweep: each system's two servers, all started once and reused across
rates (the systems take turns at each rate), and one rate point driven against a busy server.

Servers: the node benchmark's (plan.py) runs `stock_run`, `swiftcache_run`, `ideal_run` (with
the capacity the donor's lendable share is worth, known from the plan: the pages pack exactly,
so there is no need to measure it from a SwiftCache run first), and `hicache`: stock with SGLang's
`--enable-hierarchical-cache` on the busy server. The donor gets no traffic in a sweep: it is the
other model on the node, idle, holding its pool (and, with SwiftCache, lending half of it).

Between rates the busy server's cache is flushed (`/flush_cache`, retried until the server is
idle, which is when SGLang accepts it); a SwiftCache borrower then starts from an empty tree with
its leases re-attached (`SwiftRadixCache.reset`), so no rate inherits another's hits.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import aiohttp

from ..loadgen import client
from ..loadgen.client import RequestRecord
from ..loadgen.runner import warmup
from ..tools.demo import wait_for_lease
from ..tools.local_server import LocalServer, ServerStartError, start_all
from .observe import scrape
from .plan import ModelFacts, NodePlan, RunSpec, ideal_run, stock_run, swiftcache_run
from .rates import PointResult, RatePlan, Session, judge_point, start_times
from .runner import LEASE_TIMEOUT_S, STARTUP_TIMEOUT_S, _pool_of, _wait_borrowed, alerts_in

# an explicit ratio (the paper's baseline and SGLang's best practice): without one, SGLang sizes
# the host tier from free host memory above a 10 GiB reserve and refuses to start when several
# servers starting together leave less
HICACHE_ARGS = ("--enable-hierarchical-cache", "--hicache-ratio", "2")
FLUSH_TIMEOUT_S = 120.0
SERVER_COUNTERS = ("swiftcache_loaded_tokens_total", "swiftcache_stored_tokens_total",
                   "swiftcache_revoked_tokens_total")


def run_spec(system: str, node: NodePlan, busy: ModelFacts, donor: ModelFacts) -> RunSpec:
    """The node benchmark's run for `system` (hicache: stock pools, HiCache added in `Node`)."""
    if system in ("stock", "hicache"):
        return stock_run(node)
    if system == "swiftcache":
        return swiftcache_run(node)
    if system == "ideal":
        return ideal_run(node, node.lendable_busy_tokens(busy, donor),
                         int(node.donor_pool * node.lend_fraction))
    raise ValueError(f"unknown system {system!r}")


@dataclass
class Node:
    """One system's two servers (started by `start_nodes`, stopped by `stop`)."""

    system: str
    spec: RunSpec
    busy: LocalServer
    donor: LocalServer
    rendezvous: str
    error: str | None = None  # why it did not start (ServerStartError's message)
    pools: dict | None = None
    lease_wait_s: float = 0.0

    def start(self) -> None:
        """Both servers side by side (start_all); a failure is kept in `error`, not raised."""
        try:
            start_all([self.busy, self.donor])
        except ServerStartError as exc:
            self.error = str(exc)
            self.stop()

    def ready(self) -> None:
        """SwiftCache: wait until the busy server's borrowed capacity settled; then one untimed
        warm-up request (a fresh server's one-off costs) and the pools as the servers report."""
        t0 = time.monotonic()
        if self.spec.swiftcache:
            wait_for_lease(self.rendezvous, timeout_s=LEASE_TIMEOUT_S)
            _wait_borrowed(self.busy, LEASE_TIMEOUT_S)
        self.lease_wait_s = time.monotonic() - t0
        asyncio.run(warmup(self.busy.base_url, "chat"))
        self.pools = {"busy": _pool_of(self.busy), "donor": _pool_of(self.donor)}

    def stop(self) -> None:
        self.busy.stop()
        self.donor.stop()
        shutil.rmtree(self.rendezvous, ignore_errors=True)

    def alerts(self) -> dict[str, list[str]]:
        return {"busy": alerts_in(self.busy.log_text()), "donor": alerts_in(self.donor.log_text())}

    def startup_s(self) -> dict[str, float | None]:
        return {"busy": self.busy.startup_s, "donor": self.donor.startup_s}


def build_node(system: str, node: NodePlan, busy_model: Path, donor_model: Path,
               facts: dict[str, ModelFacts], out_dir: Path) -> Node:
    """`system`'s two servers, not started: the node benchmark's arguments and pools."""
    spec = run_spec(system, node, facts["busy"], facts["donor"])
    max_borrow = node.lendable_busy_tokens(facts["busy"], facts["donor"])
    rendezvous = tempfile.mkdtemp(prefix=f"ratebench-{system}-")  # private, 0700
    env = {**os.environ, "OMP_NUM_THREADS": str(node.server_threads)}
    busy_args = spec.busy_args(node, rendezvous, max_borrow)
    if system == "hicache":
        busy_args = [*busy_args, *HICACHE_ARGS]
    out_dir.mkdir(parents=True, exist_ok=True)
    busy = LocalServer(busy_model, swiftcache=spec.swiftcache, max_total_tokens=spec.busy_pool,
                       extra_args=busy_args, log_path=out_dir / f"{system}-busy.log", env=env,
                       startup_timeout_s=STARTUP_TIMEOUT_S)
    donor = LocalServer(donor_model, swiftcache=spec.swiftcache, max_total_tokens=spec.donor_pool,
                        extra_args=spec.donor_args(node, rendezvous),
                        log_path=out_dir / f"{system}-donor.log", env=env,
                        startup_timeout_s=STARTUP_TIMEOUT_S)
    return Node(system, spec, busy, donor, rendezvous)


@contextmanager
def running_nodes(nodes: list[Node]) -> Iterator[list[Node]]:
    """Start every system's servers at once and yield the ones that started and are ready.
    All systems stay up for the whole sweep and take turns at each rate, so a load change on a
    shared machine falls on every system alike; a server with no request sleeps
    (`--sleep-on-idle`), and each system has the node's memory. Every server is stopped on exit."""
    try:
        threads = [threading.Thread(target=n.start) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        up = [n for n in nodes if n.error is None]
        for n in up:
            n.ready()
        yield up
    finally:
        for n in nodes:
            n.stop()


async def _flush_when_idle(http: aiohttp.ClientSession, url: str) -> float:
    """Flush the busy server's cache once the cut requests are gone (`client.flush_when_idle`).
    Returns the seconds it took."""
    return await client.flush_when_idle(http, url, FLUSH_TIMEOUT_S)


async def _session(http, url: str, sess: Session, offset: float, max_tokens: int, t0: float,
                   records: list[RequestRecord]) -> None:
    await asyncio.sleep(offset)  # the arrival process's pacing, not a wait for a state
    messages: list[dict] = []
    for i, user in enumerate(sess.users):
        messages.append({"role": "user", "content": user})
        rec = RequestRecord(session=sess.id, turn=i + 1, server="busy", t_send=0.0)
        records.append(rec)  # listed before it is answered: a cut request still counts
        await client.chat(http, url, list(messages), max_tokens, rec, t0)
        if rec.error is not None:
            return
        messages.append({"role": "assistant", "content": rec.text})
        if i + 1 < len(sess.users) and sess.think_s[i] > 0:
            await asyncio.sleep(sess.think_s[i])  # the user's think time


async def _drive(url: str, sessions: list[Session], offsets: list[float], max_tokens: int,
                 deadline_s: float) -> tuple[list[RequestRecord], int, float]:
    """Run the sessions; cut whatever is still running at `deadline_s` (its requests stay in the
    records without a first token). Returns records, sessions finished, end time (s)."""
    records: list[RequestRecord] = []
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_session(http, url, s, o, max_tokens, t0, records))
                 for s, o in zip(sessions, offsets)]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        end_s = time.perf_counter() - t0
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        finished = sum(1 for t in done if t.exception() is None)
    return records, finished, end_s


def run_point(node: Node, plan: RatePlan, node_plan: NodePlan, rate: float,
              sessions: list[Session]) -> PointResult:
    """Flush, then one rate's sessions against the busy server, judged (rates.judge_point)."""
    async def flush() -> float:
        async with aiohttp.ClientSession() as http:
            return await _flush_when_idle(http, node.busy.base_url)

    flush_s = asyncio.run(flush())
    offsets = start_times(plan, rate)
    chosen = sessions[:len(offsets)]
    if len(chosen) < len(offsets):
        raise ValueError(f"{len(offsets)} sessions arrive at {rate}/s, only {len(sessions)} built")
    before, load_before, t_wall = scrape(node.busy.base_url) or {}, os.getloadavg(), time.time()
    records, finished, end_s = asyncio.run(_drive(node.busy.base_url, chosen, offsets,
                                                  node_plan.max_tokens,
                                                  plan.window_s + plan.drain_s))
    after = scrape(node.busy.base_url) or {}
    point = judge_point(node.system, rate, records, len(chosen), finished, plan.window_s, end_s)
    point.extra = {"loadavg_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
                   "wall_s": round(time.time() - t_wall, 1), "flush_s": round(flush_s, 2),
                   "server": {k: after.get(k, 0.0) - before.get(k, 0.0)
                              for k in SERVER_COUNTERS if k in after},
                   "records": [r.to_json() for r in records]}
    return point
