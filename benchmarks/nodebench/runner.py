"""The node benchmark's three runs and the donor twin: every server starts (the donors and the
stock busy servers side by side, then the SwiftCache busy server), each run's two servers (a
`Node`) serve their steady phase in turn, then all stay up for the rounds of donor bursts and the
reclaim-phase turns (traffic.py says why), while a sampler watches the SwiftCache run's
`/metrics`; then every server stops."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..instruments import instruments_env
from ..loadgen.client import RequestRecord
from ..tools.demo import ctl, wait_for_lease
from ..tools.local_server import LocalServer, start_all
from .observe import CapacitySampler, cpu_delta, scrape, thread_cpu_s
from .plan import ModelFacts, NodePlan, RunSpec, ideal_run, stock_run, swiftcache_run
from .traffic import (
    BusyReplay,
    Marks,
    Traffic,
    burst,
    flush_donor,
    round_order,
    session,
    steady,
    warm_up_donor,
)

LEASE_TIMEOUT_S = 180.0
STARTUP_TIMEOUT_S = 600.0  # two servers starting side by side took 85-100 s each at load ~10
# log lines worth reporting when a server misbehaves (tracebacks, errors, SwiftCache faults)
ALERT = re.compile(r"Traceback|\bERROR\b|Exception|lost \(|cannot use the lease|never lent|leak")


@dataclass
class RunResult:
    spec: RunSpec
    records: dict[str, list[RequestRecord]]
    marks: Marks
    sampler: CapacitySampler
    pools: dict[str, int]  # what each server reports as its KV pool (max_total_num_tokens)
    startup_s: dict[str, float]
    lease_wait_s: float
    wall_s: float
    loadavg: tuple[tuple[float, float, float], tuple[float, float, float]]  # before, after
    reclaims: int = 0
    reclaim_latency_sum_s: float = 0.0
    ctl_status: list = field(default_factory=list)
    own_pages_wait_ms: list = field(default_factory=list)  # (b)'s donor, per round
    round_reclaims: list = field(default_factory=list)  # (b)'s donor, reclaims done per round
    alerts: dict[str, list[str]] = field(default_factory=dict)


def _pool_of(server: LocalServer) -> int:
    with urllib.request.urlopen(server.base_url + "/server_info", timeout=30) as r:
        return int(json.loads(r.read())["max_total_num_tokens"])


def _wait_borrowed(busy: LocalServer, timeout_s: float) -> None:
    """Until the busy server's gauge shows its borrowed tokens, and two readings a gauge period
    apart agree (the lease is complete: a stable operating point to measure from)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        value = (scrape(busy.base_url) or {}).get("swiftcache_borrowed_tokens", 0.0)
        if value > 0 and value == last:
            return
        last = value
        time.sleep(1.1)  # the gauge is updated once a second
    raise RuntimeError(f"the busy server's borrowed tokens did not settle within {timeout_s:.0f}s"
                       f" (last {last}); see {busy.log_path}")


# stock SGLang with --skip-server-warmup posts /freeze_gc to itself before uvicorn listens and
# logs this line with a traceback at every start: harmless, and not what a reader looks for
KNOWN_NOISE = "post-warmup freeze_gc failed"


def alerts_in(log_text: str, limit: int = 20) -> list[str]:
    """The log lines a reader must see (errors, tracebacks, lost donor memory), minus the
    traceback that follows KNOWN_NOISE (up to the next time-stamped line)."""
    out: list[str] = []
    skipping = False
    for line in log_text.splitlines():
        if KNOWN_NOISE in line:
            skipping = True
            continue
        if skipping and not line.startswith("["):
            continue
        skipping = False
        if ALERT.search(line):
            out.append(line)
    return out[:limit]


# --diagnose: SGLang's per-request queue and forward durations, and garbage collections of the
# HTTP server's process over 50 ms, in each server's log
DIAGNOSE_ARGS = ("--enable-request-time-stats-logging", "--gc-warning-threshold-secs", "0.05")


# Every server's glibc malloc keeps the memory its forwards free (a fixed mmap threshold, so
# activations up to 32 MiB come from the heap; a trim threshold no heap reaches, so none is given
# back), as PyTorch's caching allocator does on a GPU. With glibc's defaults a forward re-faulted
# whatever earlier frees had given back to the kernel, by an amount that depended on the heap's
# history: the donor's burst took 4,186 page faults in one stock run and 11,191 in the SwiftCache
# run beside it (its prefill 179 ms against 152), and none with these (docs/node_bench.md).
# Legacy variables, not GLIBC_TUNABLES: glibc rewrites that one in the environment a process
# passes on, so SGLang's scheduler processes would not see all of it.
MALLOC_KEEPS_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                       "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def forward_trace_path(out_dir: Path, spec: RunSpec, role: str) -> Path:
    """Where a server of a --diagnose run appends one JSON line per forward pass (its wall and
    thread CPU time: `benchmarks.instruments`, SWIFTCACHE_FORWARD_TRACE)."""
    return out_dir / f"{spec.name}-{role}.forward.jsonl"


def bench_server(model: Path, spec: RunSpec, role: str, pool: int, args: list[str],
                 plan: NodePlan, out_dir: Path, diagnose: bool) -> LocalServer:
    """One benchmark server: `plan.server_threads` torch threads, malloc keeping what its
    forwards free (MALLOC_KEEPS_MEMORY), its log in OUT/<run>-<role>.log; a busy server with
    `plan.busy_tp` > 1 also its ranks' core binding (`NodePlan.busy_env`; `busy_args` carries
    the --tp); with `diagnose` also DIAGNOSE_ARGS and a fresh forward trace
    (`forward_trace_path`)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(plan.server_threads), **MALLOC_KEEPS_MEMORY}
    if role == "busy":
        env.update(plan.busy_env(os.cpu_count() or 1))
    extra: list[str] = []
    if diagnose:
        path = forward_trace_path(out_dir, spec, role)
        path.unlink(missing_ok=True)  # the server appends
        env = instruments_env(env, forward_trace=str(path.resolve()))
        extra = list(DIAGNOSE_ARGS)
    return LocalServer(model, swiftcache=spec.swiftcache, max_total_tokens=pool,
                       extra_args=[*args, *extra], log_path=out_dir / f"{spec.name}-{role}.log",
                       env=env, startup_timeout_s=STARTUP_TIMEOUT_S)


class CpuPhases:
    """--diagnose: CPU seconds per thread of each server's processes in each traffic phase
    (`steady`: the run's steady phase; `bursts and reclaim`: from there to the end, the other
    runs' bursts and turns included, during which this run's servers are idle)."""

    def __init__(self, servers: dict[str, LocalServer]) -> None:
        self.servers = servers
        self.readings = [("start", self._read())]

    def _read(self) -> dict[str, dict[str, float]]:
        return {role: thread_cpu_s(s.proc.pid) for role, s in self.servers.items()}

    def mark(self, phase: str) -> None:
        self.readings.append((phase, self._read()))

    def deltas(self) -> dict[str, dict[str, dict[str, float]]]:
        names = {"bursts": "steady", "end": "bursts and reclaim"}
        return {names.get(p1, p1): {role: cpu_delta(r0[role], r1[role]) for role in r1}
                for (_, r0), (p1, r1) in zip(self.readings, self.readings[1:])}


class Node:
    """One run's two servers, from their start to the end of the benchmark (`start_servers`
    starts them: the donor first, warmed by `warm_up_donor` before the busy server starts; with
    SwiftCache, the busy server has borrowed before any traffic). With `diagnose`, every server
    also traces its forward passes (`forward_trace_path`), its threads' CPU per traffic phase
    goes to OUT/<run>-cpu.json (`CpuPhases`), and its log has DIAGNOSE_ARGS' lines."""

    def __init__(self, spec: RunSpec, plan: NodePlan, busy_model: Path, donor_model: Path,
                 traffic: Traffic, out_dir: Path, max_borrow_blocks: int,
                 diagnose: bool = False) -> None:
        self.spec, self.plan, self.traffic, self.out_dir = spec, plan, traffic, out_dir
        self.diagnose = diagnose
        out_dir.mkdir(parents=True, exist_ok=True)
        self.rendezvous = tempfile.mkdtemp(prefix=f"nodebench-{spec.key}-")  # private, 0700
        self.busy = bench_server(busy_model, spec, "busy", spec.busy_pool,
                                 spec.busy_args(plan, self.rendezvous, max_borrow_blocks),
                                 plan, out_dir, diagnose)
        self.donor = bench_server(donor_model, spec, "donor", spec.donor_pool,
                                  spec.donor_args(plan, self.rendezvous), plan, out_dir, diagnose)
        self.records: dict[str, list[RequestRecord]] = {"burst": []}
        self.marks: Marks | None = None
        self.replay: BusyReplay | None = None
        self.sampler: CapacitySampler | None = None
        self.cpu: CpuPhases | None = None
        self.pools: dict[str, int] = {}
        self.lease_wait_s = 0.0
        self.loadavg: list[tuple[float, float, float]] = []
        self._t_start = time.monotonic()

    def register(self, stack: ExitStack) -> None:
        """`stack` stops both servers (and removes the rendezvous) when it closes."""
        stack.callback(shutil.rmtree, self.rendezvous, True)
        stack.callback(self.donor.stop)
        stack.callback(self.busy.stop)
        self._t_start = time.monotonic()

    def await_lease(self) -> None:
        """SwiftCache: until the busy server holds its lease, borrowed tokens settled; then
        both servers' pools as they report them."""
        t_ready = time.monotonic()
        if self.spec.swiftcache:
            wait_for_lease(self.rendezvous, timeout_s=LEASE_TIMEOUT_S)
            _wait_borrowed(self.busy, LEASE_TIMEOUT_S)
        self.lease_wait_s = time.monotonic() - t_ready
        self.pools = {"busy": _pool_of(self.busy), "donor": _pool_of(self.donor)}

    def steady(self) -> None:
        """Phase 1 (traffic.steady) while this run's sampler watches its two servers."""
        self.loadavg.append(os.getloadavg())
        servers = {"busy": self.busy, "donor": self.donor}
        self.cpu = CpuPhases(servers) if self.diagnose else None
        self.marks = Marks(t0=time.perf_counter())
        self.replay = BusyReplay(self.busy.base_url, self.traffic, self.plan, self.marks.t0)
        self.sampler = CapacitySampler({k: s.base_url for k, s in servers.items()},
                                       self.plan.sample_interval_s, self.marks.t0)
        with self.sampler:
            self.records.update(asyncio.run(steady(self.busy.base_url, self.donor.base_url,
                                                   self.traffic, self.plan, self.replay,
                                                   self.marks)))
        if self.cpu is not None:
            self.cpu.mark("bursts")

    async def burst(self, http, round_no: int) -> None:
        self.records["burst"] += await burst(http, self.donor.base_url, self.traffic, self.plan,
                                             self.marks, round_no)

    def busy_reclaim(self) -> None:
        """Phase 3: each busy conversation's next turn."""
        async def turns():
            async with session() as http:
                return await self.replay.turns(http, self.plan.turns, self.plan.turns + 1)

        self.records["busy_reclaim"] = asyncio.run(turns())
        self.marks.traffic_end = self.marks.now()

    def wait_lent(self, tokens: float, reclaims: float,
                  timeout_s: float = LEASE_TIMEOUT_S) -> bool:
        """SwiftCache: until the donor shows `reclaims` reclaims done and lends `tokens` again
        (its relend follows a reclaim by its cooldown, all at once), then until the busy server
        holds a lease; False when that did not happen in time. The gauges are updated once a
        second, so a lent reading alone can still be the one from before the last burst's
        reclaim; the reclaim count in the same reading says it is not."""
        deadline = time.monotonic() + timeout_s

        def relent(m: dict) -> bool:
            return (m.get("swiftcache_reclaim_latency_seconds_count", 0.0) >= reclaims
                    and m.get("swiftcache_lent_tokens", 0.0) >= tokens)

        for server, ready in ((self.donor, relent),
                              (self.busy, lambda m: m.get("swiftcache_borrowed_tokens", 0) > 0)):
            while not ready(scrape(server.base_url) or {}):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.25)  # polling gauges the server updates once a second
        return True

    def result(self) -> RunResult:
        if self.cpu is not None:
            self.cpu.mark("end")
            (self.out_dir / f"{self.spec.name}-cpu.json").write_text(
                json.dumps(self.cpu.deltas(), indent=1))
        for server in (self.busy, self.donor):
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.log_path.name}: the server exited during the run "
                                   f"(code {server.proc.returncode}):\n{server.log_tail(40)}")
        final = scrape(self.donor.base_url) or {}
        status = []
        if self.spec.swiftcache:
            try:
                status = json.loads(ctl(self.rendezvous, json_out=True))
            except ValueError:
                status = []
        self.loadavg.append(os.getloadavg())
        return RunResult(
            spec=self.spec, records=self.records, marks=self.marks, sampler=self.sampler,
            pools=self.pools, startup_s={"busy": self.busy.startup_s,
                                         "donor": self.donor.startup_s},
            lease_wait_s=self.lease_wait_s, wall_s=time.monotonic() - self._t_start,
            loadavg=(self.loadavg[0], self.loadavg[-1]),
            reclaims=int(final.get("swiftcache_reclaim_latency_seconds_count", 0)),
            reclaim_latency_sum_s=final.get("swiftcache_reclaim_latency_seconds_sum", 0.0),
            ctl_status=status,
            alerts={"busy": alerts_in(self.busy.log_text()),
                    "donor": alerts_in(self.donor.log_text())})


class DonorTwin:
    """A second stock donor, the same as (a)'s (model, pool, arguments, warm-up, malloc), that
    serves only the rounds' bursts, in the same rounds as the three runs' donors: what two
    identical servers' burst TTFT P99s differ by on this machine (`donor_ttft_p99_noise`), the
    floor under any donor ratio the benchmark reports. No busy server, no light traffic."""

    busy = None

    def __init__(self, plan: NodePlan, donor_model: Path, traffic: Traffic, out_dir: Path,
                 diagnose: bool = False) -> None:
        self.spec = RunSpec("t", "stock-twin", 0, plan.donor_pool, swiftcache=False)
        self.plan, self.traffic, self.diagnose = plan, traffic, diagnose
        self.donor = bench_server(donor_model, self.spec, "donor", plan.donor_pool,
                                  self.spec.donor_args(plan, ""), plan, out_dir, diagnose)
        self.records: dict[str, list[RequestRecord]] = {"burst": []}
        self.marks = Marks(t0=time.perf_counter())

    def register(self, stack: ExitStack) -> None:
        stack.callback(self.donor.stop)

    async def burst(self, http, round_no: int) -> None:
        self.records["burst"] += await burst(http, self.donor.base_url, self.traffic, self.plan,
                                             self.marks, round_no)


def start_servers(nodes: list[Node], twin: DonorTwin | None, stack: ExitStack, log) -> None:
    """Every donor and every stock busy server side by side (`start_all`: start-up is mostly
    imports, on both cores), each donor then warmed one after another; then the SwiftCache busy
    servers, and each SwiftCache run's lease. So a SwiftCache donor has run its warm-up before
    its borrower exists (nothing is lent or cached before the traffic), every donor runs its
    warm-up beside idle servers only, and the last step starts only what must wait for it."""
    donors = [n.donor for n in nodes] + ([twin.donor] if twin is not None else [])
    for n in nodes + ([twin] if twin is not None else []):
        n.register(stack)
    t = time.monotonic()
    start_all(donors + [n.busy for n in nodes if not n.spec.swiftcache])
    for n in nodes + ([twin] if twin is not None else []):
        warm_up_donor(n.donor.base_url, n.traffic)
    log(f"{len(donors)} donors and the stock busy servers up, the donors warmed, in "
        f"{time.monotonic() - t:.0f}s")
    t = time.monotonic()
    start_all([n.busy for n in nodes if n.spec.swiftcache])
    for n in nodes:
        n.await_lease()
    log(f"the SwiftCache busy server up in {time.monotonic() - t:.0f}s (lease wait "
        + ", ".join(f"{n.spec.key} {n.lease_wait_s:.1f}s" for n in nodes) + ")")


def check_ideal(ideal: RunSpec, plan: NodePlan, b: Node) -> None:
    """(c) starts with the other runs, sized by the plan's loan (`NodePlan.planned_loan`); once
    (b)'s steady phase is done, what (b) moved must be that loan (the most the busy server
    borrowed, its tokens; the most the donor lent, its tokens), or (c) is not the capacity-equal
    ideal of this run: raises, naming both."""
    moved = (int(b.sampler.peak("busy", "swiftcache_borrowed_tokens") or 0),
             int(b.sampler.peak("donor", "swiftcache_lent_tokens") or 0))
    sized = (ideal.busy_pool - plan.busy_pool, plan.donor_pool - ideal.donor_pool)
    if moved != sized:
        raise RuntimeError(
            f"(b) moved {moved[0]} busy tokens borrowed / {moved[1]} donor tokens lent, but the "
            f"ideal run (c) was sized for the plan's loan, {sized[0]} / {sized[1]}: (c) would not "
            f"hold (b)'s memory; see {b.busy.log_path} and {b.donor.log_path}")


def run_node(plan: NodePlan, busy_model: Path, donor_model: Path, traffic: Traffic,
             out_dir: Path, max_borrow_blocks: int, diagnose: bool = False, twin: bool = True,
             log=print) -> tuple[dict[str, RunResult], DonorTwin | None]:
    """The three runs (plan.py) and the donor twin: every server starts (`start_servers`), (c)
    sized by the plan's loan; (a), (b), (c) serve their steady phase in turn, (b)'s loan then
    checked against (c)'s sizes (`check_ideal`); then `plan.burst_rounds` rounds of donor
    bursts, the four donors one after another in `round_order`, each flushed after its burst
    and the SwiftCache donor lending again before the next one (`_burst_rounds`); then each
    run's reclaim-phase turns; `plan.settle_s` of observation; every server stops. Idle servers
    sleep (--sleep-on-idle, LocalServer's CPU args): a run's steady phase has the machine to
    itself but for the idle servers' control threads."""
    busy_loan, donor_loan = plan.planned_loan(ModelFacts.from_dir(busy_model),
                                              ModelFacts.from_dir(donor_model))
    specs = (stock_run(plan), swiftcache_run(plan), ideal_run(plan, busy_loan, donor_loan))
    with ExitStack() as stack:
        nodes = {s.key: Node(s, plan, busy_model, donor_model, traffic, out_dir,
                             max_borrow_blocks, diagnose) for s in specs}
        extra = DonorTwin(plan, donor_model, traffic, out_dir, diagnose) if twin else None
        for s in specs:
            log(f"[{s.key}] {s.name}: busy pool {s.busy_pool}, donor pool {s.donor_pool}")
        if extra is not None:
            log(f"[{extra.spec.key}] {extra.spec.name}: donor pool {extra.spec.donor_pool}, "
                f"bursts only")
        start_servers(list(nodes.values()), extra, stack, log)
        b = nodes["b"]
        for node in nodes.values():
            t = time.monotonic()
            node.steady()
            log(f"[{node.spec.key}] steady phase done in {time.monotonic() - t:.0f}s (start-up "
                f"{node.busy.startup_s:.0f}s, {node.donor.startup_s:.0f}s; load average "
                f"{os.getloadavg()[0]:.2f})")
            if node is b:
                check_ideal(nodes["c"].spec, plan, b)
        before = scrape(b.donor.base_url) or {}
        bursters = {**nodes, **({extra.spec.key: extra} if extra is not None else {})}
        burst_cpu, readings = _burst_rounds(
            bursters, b, before.get("swiftcache_lent_tokens", 0.0),
            before.get("swiftcache_reclaim_latency_seconds_count", 0.0), log)
        if burst_cpu:
            (out_dir / "burst-cpu.json").write_text(json.dumps(burst_cpu, indent=1))
        with b.sampler:  # the last reclaim and the relend, for the plot and reclaim_view
            for node in nodes.values():
                node.busy_reclaim()
            time.sleep(plan.settle_s)  # the observation window after the traffic, not a sync
        readings.append(scrape(b.donor.base_url) if readings else None)
        results = {k: node.result() for k, node in nodes.items()}
        results["b"].own_pages_wait_ms = [None if d is None else round(1e3 * d, 1)
                                          for d in per_round(readings, OWN_WAIT)]
        results["b"].round_reclaims = per_round(readings, RECLAIMS)
        return results, extra


OWN_WAIT = "swiftcache_own_pages_wait_seconds_total"
RECLAIMS = "swiftcache_reclaim_latency_seconds_count"


def per_round(readings: list[dict | None], name: str) -> list[float | None]:
    """How much counter `name` grew in each round, from scrapes of a server before each round
    and once after the last (None where a scrape or the counter is missing)."""
    values = [None if m is None else m.get(name) for m in readings]
    return [None if x is None or y is None else y - x for x, y in zip(values, values[1:])]


def _burst_rounds(nodes: dict[str, Any], b: Node, lent: float, reclaims: float,
                  log) -> tuple[list[dict], list[dict | None]]:
    """The donors' bursts (traffic.py, phase 2), one after another in each round's order. After
    its burst in every round but the last, each donor's cache is flushed (so the next burst is
    computed again); the SwiftCache donor `b`, `reclaims` reclaims done before the first round,
    is then waited for until it lends `lent` tokens again (its cooldown after the burst's
    reclaim) and its borrower holds the loan, before the next burst of any donor: every burst of
    `b` meets a loan to reclaim, and no relend runs beside another donor's burst. `b`'s sampler
    watches those waits (its reclaims and relends) but not the bursts: a `/metrics` scrape costs
    a SwiftCache server's HTTP process 10-20 ms of CPU (SGLang's multiprocess collection), and
    one that met (b)'s burst in that process would delay only (b)'s first tokens. Returns, with
    --diagnose, each burst's CPU ms of every server (`_server_cpu_s`: which process ran beside
    the donor's forward), and a scrape of `b`'s donor before each round, its loan back (its
    counters OWN_WAIT and RECLAIMS; `per_round` takes the differences, the caller adds a
    reading after the last). Without a loan (`lent` 0) nothing is read."""
    plan = b.plan
    keys = list(nodes)
    burst_cpu: list[dict] = []
    readings: list[dict | None] = []
    t = time.monotonic()
    for r in range(plan.burst_rounds):
        if lent:
            readings.append(scrape(b.donor.base_url))

        async def one_round(r=r):
            async with session() as http:
                for key in round_order(keys, r):
                    node = nodes[key]
                    before = _server_cpu_s(nodes) if b.diagnose else None
                    await node.burst(http, r)
                    if before is not None:
                        after = _server_cpu_s(nodes)
                        burst_cpu.append({"round": r + 1, "run": key, "cpu_ms": {
                            k: round(1e3 * (after[k] - before[k]), 1) for k in after}})
                    if r + 1 == plan.burst_rounds:
                        continue
                    await flush_donor(http, node.donor.base_url)
                    if node is b and lent:
                        with b.sampler:
                            ok = await asyncio.to_thread(b.wait_lent, lent, reclaims + r + 1)
                        if not ok:
                            log(f"[{b.spec.key}] the donor did not lend {lent:.0f} tokens again "
                                f"after round {r + 1}; its next burst goes without a loan")

        asyncio.run(one_round())
    log(f"{plan.burst_rounds} rounds of donor bursts done in {time.monotonic() - t:.0f}s")
    return burst_cpu, readings


def _server_cpu_s(nodes: dict[str, Any]) -> dict[str, float]:
    """--diagnose: CPU seconds so far of each server's process tree, "<run>-<role>"."""
    return {f"{key}-{role}": sum(thread_cpu_s(server.proc.pid).values())
            for key, node in nodes.items()
            for role, server in (("busy", node.busy), ("donor", node.donor))
            if server is not None}
