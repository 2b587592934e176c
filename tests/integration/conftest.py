"""Fixtures shared by the integration tests."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from benchmarks.loadgen.client import flush_when_idle
from benchmarks.peers.peer_process import SimGroup
from benchmarks.tools.local_server import LocalServer


@pytest.fixture
def sims():
    """Simulated control agents in their own processes; all of them end with the test."""
    group = SimGroup()
    try:
        yield group
    finally:
        group.close()


def event(name: str, **match):
    """A predicate on a simulated agent's event: its name and the given fields."""
    return lambda e: e["ev"] == name and all(e.get(k) == v for k, v in match.items())


DETECTION_TIMEOUT_S = 1.0  # the simulated agents' heartbeat timeout (their default)
DETECTION_SLACK_S = 0.5  # scheduling noise on a loaded 2-core machine (ticks every 0.1 s, the kill)


def own_pauses(proc) -> tuple[int, float]:
    """A simulated agent's own pauses so far: (how many, the longest in seconds)."""
    counters = proc.status()["counters"]
    return counters.get("own_pauses", 0), counters.get("max_own_pause_ms", 0) / 1000


def detection_bound(proc, pauses_before: tuple[int, float]) -> float:
    """What liveness.py states: a killed peer is declared dead within the heartbeat timeout of
    the kill plus one tick, later only by the detecting agent's own pauses (a thread that does
    not run detects nothing, and its pauses are not counted against its peers). The slack covers
    the tick and scheduling; a pause of its own since `pauses_before` adds the longest one.
    Measure against `PeerChanged.at`, the verdict's instant, not when the event was printed."""
    count, longest = own_pauses(proc)
    return DETECTION_TIMEOUT_S + DETECTION_SLACK_S + (longest if count > pauses_before[0] else 0.0)


def borrow(donor, borrower, n: int) -> dict:
    """Have `borrower` lease `n` blocks from `donor` once it sees it lendable; the grant event."""
    borrower.status_until(
        lambda st: any(q["agent_id"] == donor.agent_id and q["lendable"] for q in st["peers"])
    )
    start = len(borrower.events)
    borrower.send("request", n=n, donor=donor.agent_id)
    return borrower.wait_for(event("LeaseGranted"), 10, start)


class StockServers:
    """Stock SGLang reference servers, one per (model, KV pool, arguments), started on first use
    and shared by every test that asks for the same one: a start is ~25 s of this machine's two
    cores, and a reference needs no fresh process, only an empty cache. `get` flushes the cache
    of a server it hands out again (SGLang's /flush_cache resets the radix tree and the pool), so
    each test meets the state of a fresh server. The shared servers sleep when idle
    (LocalServer's CPU args: no scheduler spinning on a core through later tests) and run no
    SwiftCache agent (stock), so they cannot join another test's node."""

    MAX_LIVE = 4  # servers kept at once (about 1.8 GB each here); the least recently used goes

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self._servers: dict[tuple, LocalServer] = {}  # least recently used first
        self._memo: dict[tuple, object] = {}
        self._started = 0

    def get(self, model, pool: int, args) -> LocalServer:
        key = (str(model), pool, tuple(args))
        server = self._servers.pop(key, None)
        if server is not None:
            if server.proc.poll() is None:
                self._flush(server)
                self._servers[key] = server
                return server
            server.stop()  # it died: its process group goes before a new one takes its place
        while len(self._servers) >= self.MAX_LIVE:
            self._servers.pop(next(iter(self._servers))).stop()
        server = LocalServer(model, swiftcache=False, max_total_tokens=pool,
                             extra_args=list(args),
                             log_path=self.log_dir / f"stock-{self._started}.log")
        self._started += 1
        server.start()
        self._servers[key] = server
        return server

    def memo(self, key: tuple, compute):
        """`compute()`'s result, computed once per `key` in the session: a stock reference that
        several tests take alike (stock's greedy answers to the same prompts)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    @staticmethod
    def _flush(server: LocalServer, timeout_s: float = 60.0) -> None:
        async def flush():
            async with aiohttp.ClientSession() as http:
                await flush_when_idle(http, server.base_url, timeout_s)

        asyncio.run(flush())

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


@pytest.fixture(scope="session")
def stock_servers(tmp_path_factory):
    """The session's shared stock reference servers (`StockServers.get(model, pool, args)`)."""
    servers = StockServers(tmp_path_factory.mktemp("stock-servers"))
    try:
        yield servers
    finally:
        servers.close()
