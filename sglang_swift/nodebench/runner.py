"""One run of the node benchmark: start both servers, wait for the lease (SwiftCache), drive the
traffic while a sampler watches `/metrics`, keep watching `plan.settle_s` more, stop both."""

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

from ..layer_stream.hooks import FORWARD_TRACE_ENV
from ..loadgen.client import RequestRecord
from ..tools.demo import ctl, wait_for_lease
from ..tools.local_server import LocalServer
from .observe import CapacitySampler, cpu_delta, scrape, thread_cpu_s
from .plan import NodePlan, RunSpec
from .traffic import Marks, Traffic, drive, warm_up_donor

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
    thread CPU time: `layer_stream.hooks`, SWIFTCACHE_FORWARD_TRACE)."""
    return out_dir / f"{spec.name}-{role}.forward.jsonl"


class CpuPhases:
    """--diagnose: CPU seconds per thread of each server's processes in each traffic phase
    (`steady`: from the start to the reclaim phase; `reclaim`: from there to the end)."""

    def __init__(self, servers: dict[str, LocalServer]) -> None:
        self.servers = servers
        self.readings = [("start", self._read())]

    def _read(self) -> dict[str, dict[str, float]]:
        return {role: thread_cpu_s(s.proc.pid) for role, s in self.servers.items()}

    def mark(self, phase: str) -> None:
        self.readings.append((phase, self._read()))

    def deltas(self) -> dict[str, dict[str, dict[str, float]]]:
        names = {"reclaim": "steady", "end": "reclaim"}
        return {names.get(p1, p1): {role: cpu_delta(r0[role], r1[role]) for role in r1}
                for (_, r0), (p1, r1) in zip(self.readings, self.readings[1:])}


def run_one(spec: RunSpec, plan: NodePlan, busy_model: Path, donor_model: Path,
            traffic: Traffic, out_dir: Path, max_borrow_blocks: int,
            diagnose: bool = False) -> RunResult:
    """One run: the donor starts and is warmed (`warm_up_donor`), then the busy server starts,
    then the traffic. With `diagnose`, every server also traces its forward passes
    (`forward_trace_path`), its threads' CPU per phase goes to OUT/<run>-cpu.json (`CpuPhases`),
    and its log has DIAGNOSE_ARGS' lines."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rendezvous = tempfile.mkdtemp(prefix=f"nodebench-{spec.key}-")  # private, 0700
    env = {**os.environ, "OMP_NUM_THREADS": str(plan.server_threads), **MALLOC_KEEPS_MEMORY}
    extra = list(DIAGNOSE_ARGS) if diagnose else []

    def env_of(role: str) -> dict[str, str]:
        if not diagnose:
            return env
        path = forward_trace_path(out_dir, spec, role)
        path.unlink(missing_ok=True)  # the server appends
        return {**env, FORWARD_TRACE_ENV: str(path.resolve())}

    busy = LocalServer(busy_model, swiftcache=spec.swiftcache, max_total_tokens=spec.busy_pool,
                       extra_args=spec.busy_args(plan, rendezvous, max_borrow_blocks) + extra,
                       log_path=out_dir / f"{spec.name}-busy.log", env=env_of("busy"),
                       startup_timeout_s=STARTUP_TIMEOUT_S)
    donor = LocalServer(donor_model, swiftcache=spec.swiftcache,
                        max_total_tokens=spec.donor_pool,
                        extra_args=spec.donor_args(plan, rendezvous) + extra,
                        log_path=out_dir / f"{spec.name}-donor.log", env=env_of("donor"),
                        startup_timeout_s=STARTUP_TIMEOUT_S)
    t_start = time.monotonic()
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, rendezvous, True)
        stack.callback(donor.stop)
        stack.callback(busy.stop)
        donor.start()  # first, and warmed before the busy server exists (`warm_up_donor`)
        warm_up_donor(donor.base_url, traffic)
        busy.start()
        t_ready = time.monotonic()
        if spec.swiftcache:
            wait_for_lease(rendezvous, timeout_s=LEASE_TIMEOUT_S)
            _wait_borrowed(busy, LEASE_TIMEOUT_S)
        lease_wait_s = time.monotonic() - t_ready
        pools = {"busy": _pool_of(busy), "donor": _pool_of(donor)}
        load_before = os.getloadavg()
        cpu = CpuPhases({"busy": busy, "donor": donor}) if diagnose else None
        marks = Marks(t0=time.perf_counter())
        with CapacitySampler({"busy": busy.base_url, "donor": donor.base_url},
                             plan.sample_interval_s, marks.t0) as sampler:
            records = asyncio.run(drive(busy.base_url, donor.base_url, traffic, plan, marks,
                                        on_phase=cpu.mark if cpu else None))
            time.sleep(plan.settle_s)  # the observation window after the traffic, not a sync
        if cpu is not None:
            (out_dir / f"{spec.name}-cpu.json").write_text(json.dumps(cpu.deltas(), indent=1))
        for server in (busy, donor):
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.log_path.name}: the server exited during the run "
                                   f"(code {server.proc.returncode}):\n{server.log_tail(40)}")
        final = scrape(donor.base_url) or {}
        status = []
        if spec.swiftcache:
            try:
                status = json.loads(ctl(rendezvous, json_out=True))
            except ValueError:
                status = []
        result = RunResult(
            spec=spec, records=records, marks=marks, sampler=sampler, pools=pools,
            startup_s={"busy": busy.startup_s, "donor": donor.startup_s},
            lease_wait_s=lease_wait_s, wall_s=time.monotonic() - t_start,
            loadavg=(load_before, os.getloadavg()),
            reclaims=int(final.get("swiftcache_reclaim_latency_seconds_count", 0)),
            reclaim_latency_sum_s=final.get("swiftcache_reclaim_latency_seconds_sum", 0.0),
            ctl_status=status,
            alerts={"busy": alerts_in(busy.log_text()), "donor": alerts_in(donor.log_text())})
    return result
