"""Benchmark of the donation control channel over ipc, with real processes.

Prints lease grant latency (request -> LeaseGranted at the borrower's owner) p50/p99, reclaim
round trip (donor owner's demand -> BlocksReturned, the borrower acknowledging from its own
event loop) p50/p99, and protocol messages per second through one agent (pipelined lease
churn, 32 requests in flight), first as the machine is ("idle": nothing of ours runs besides
the agents measured), then under load (one CPU-spinning process per core). The last line is
JSON; its unprefixed keys are the idle figures, ``load_*`` the loaded ones, and ``loadavg``
the 1-minute load average seen at start, so a busy "idle" machine is visible.
``busy_owner_grant_*``: grant latency while another Python thread of the borrower's process
spins, as a scheduler loop would; the agent's thread then waits for the GIL.
``manual_grant_*``: the borrower's agent in manual mode (``start(thread=False)``), pumped by
its owner's loop.

    python scripts/bench_control.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.peers.block_region import lend_blocks
from sglang_swift.common.private_resources import sweep_shm
from sglang_swift.control import (
    BlocksReturned,
    ControlAgent,
    ControlConfig,
    LeaseGranted,
    RequestFailed,
)

SIM = [sys.executable, "-m", "benchmarks.peers.control_peer"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def spawn(rdv: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [*SIM, "--rendezvous-dir", rdv, "--quiet-events", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()  # {"ev": "ready"} (blocks until the agent is up)
    assert '"ready"' in line, line
    return proc


def wait_event(agent: ControlAgent, kind, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        e = agent.next_event(left)
        if isinstance(e, kind) or isinstance(e, RequestFailed):
            return e
    raise TimeoutError(kind.__name__)


def _spin(stop: threading.Event) -> None:
    """A stand-in for a busy scheduler loop: pure Python that holds the GIL."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def bench_grants(rdv: str, n: int, busy_owner: bool = False) -> list[float]:
    agent = ControlAgent(ControlConfig("bench-borrower", rendezvous_dir=rdv)).start()
    stop = threading.Event()
    if busy_owner:
        threading.Thread(target=_spin, args=(stop,), daemon=True).start()
    try:
        assert agent.wait_until(
            lambda a: a.peers.get("sim-donor") and a.peers["sim-donor"].lendable > 0, 10
        )
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            agent.request(4, donor="sim-donor")
            e = wait_event(agent, LeaseGranted)
            lat.append(time.perf_counter() - t0)
            if isinstance(e, LeaseGranted):
                agent.release(e.key)
        return lat
    finally:
        stop.set()
        agent.stop()


def bench_grants_manual(rdv: str, n: int) -> list[float]:
    """The borrower's agent in manual mode: the owner's loop pumps it (no I/O thread)."""
    agent = ControlAgent(ControlConfig("bench-manual", rendezvous_dir=rdv)).start(thread=False)
    try:
        deadline = time.monotonic() + 10
        while not (agent.peers.get("sim-donor") and agent.peers["sim-donor"].lendable):
            agent.pump(0.01)
            assert time.monotonic() < deadline, "donor not found"
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            rid = agent.request(4, donor="sim-donor")
            got = None
            while got is None:
                agent.pump(0.001)
                for e in agent.poll_events():
                    if isinstance(e, (LeaseGranted, RequestFailed)) and e.request_id == rid:
                        got = e
                assert time.perf_counter() - t0 < 5, "no answer"
            lat.append(time.perf_counter() - t0)
            if isinstance(got, LeaseGranted):
                agent.release(got.key)
        return lat
    finally:
        agent.stop()


def bench_msgs(rdv: str, seconds: float, window: int = 32) -> float:
    agent = ControlAgent(ControlConfig("bench-pipe", rendezvous_dir=rdv)).start()
    try:
        assert agent.wait_until(
            lambda a: a.peers.get("sim-donor") and a.peers["sim-donor"].lendable > 0, 10
        )
        for _ in range(window):
            agent.request(1, donor="sim-donor")
        c0 = agent.status().counters
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            e = agent.next_event(1.0)
            if isinstance(e, LeaseGranted):
                agent.release(e.key)
            if isinstance(e, (LeaseGranted, RequestFailed)):
                agent.request(1, donor="sim-donor")
        c1 = agent.status().counters
        dt = time.perf_counter() - t0
        msgs = sum(c1.get(k, 0) - c0.get(k, 0) for k in ("msgs_in", "msgs_out"))
        return msgs / dt
    finally:
        agent.stop()


def bench_reclaims(rdv: str, n: int) -> list[float]:
    arena, descriptor = lend_blocks(64, 512, name_prefix="swcbench")
    agent = ControlAgent(ControlConfig("bench-donor", rendezvous_dir=rdv),
                         memory=descriptor).start()
    borrower = spawn(rdv, "--agent-id", "sim-borrower", "--auto-ack")
    try:
        agent.offer(range(64))
        assert agent.wait_until(lambda a: "sim-borrower" in a.peers, 10)
        lat = []
        for _ in range(n):
            for _ in range(20):  # the borrower may not have seen our advert yet
                borrower.stdin.write(
                    json.dumps({"op": "request", "n": 64, "donor": "bench-donor"}) + "\n"
                )
                borrower.stdin.flush()
                if agent.wait_until(lambda a: a.status().lent == 64, 0.5):
                    break
            else:
                raise TimeoutError("borrower never borrowed")
            t0 = time.perf_counter()
            agent.demand(8)
            back = wait_event(agent, BlocksReturned)
            lat.append(time.perf_counter() - t0)
            agent.offer(back.blocks)  # lend them again for the next round
            borrower.stdin.write(json.dumps({"op": "release_all"}) + "\n")
            borrower.stdin.flush()
            assert agent.wait_until(lambda a: a.status().lent == 0, 10)
        return lat
    finally:
        borrower.kill()
        borrower.wait()
        agent.stop()
        arena.close()


def run_round(rdv: str, n: int, seconds: float) -> dict:
    donor = spawn(rdv, "--agent-id", "sim-donor", "--donate", "4096")
    try:
        grants = bench_grants(rdv, n)
        busy = bench_grants(rdv, max(100, n // 10), busy_owner=True)
        manual = bench_grants_manual(rdv, n)
        msgs = bench_msgs(rdv, seconds)
    finally:
        donor.kill()
        donor.wait()
        sweep_shm(donor.pid)  # killed, so its region is still there
    reclaims = bench_reclaims(rdv, max(20, n // 10))
    return {
        "grant_p50_ms": pct(grants, 0.5) * 1e3,
        "grant_p99_ms": pct(grants, 0.99) * 1e3,
        "reclaim_p50_ms": pct(reclaims, 0.5) * 1e3,
        "reclaim_p99_ms": pct(reclaims, 0.99) * 1e3,
        "msgs_per_s": msgs,
        "manual_grant_p50_ms": pct(manual, 0.5) * 1e3,
        "manual_grant_p99_ms": pct(manual, 0.99) * 1e3,
        "busy_owner_grant_p50_ms": pct(busy, 0.5) * 1e3,
        "busy_owner_grant_p99_ms": pct(busy, 0.99) * 1e3,
        "grants": len(grants),
        "reclaims": len(reclaims),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples; under 30 s")
    args = ap.parse_args()
    n, seconds = (300, 1.0) if args.quick else (3000, 3.0)
    loadavg = os.getloadavg()[0]
    root = tempfile.mkdtemp(prefix="swcb")
    rdv = os.path.join(root, "r")
    burners: list[subprocess.Popen] = []
    try:
        idle = run_round(rdv, n, seconds)
        burners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)
        ]
        load = run_round(rdv, n, seconds)
    finally:
        for b in burners:
            b.kill()
            b.wait()
        shutil.rmtree(root, ignore_errors=True)
    print(f"1-min load average at start: {loadavg:.2f} on {os.cpu_count()} cpus")
    for name, r in (("idle", idle), ("load", load)):
        print(
            f"{name:5s} grant p50 {r['grant_p50_ms']:.3f} ms  p99 {r['grant_p99_ms']:.3f} ms "
            f"({r['grants']} grants) | reclaim p50 {r['reclaim_p50_ms']:.3f} ms  "
            f"p99 {r['reclaim_p99_ms']:.3f} ms ({r['reclaims']}) | {r['msgs_per_s']:.0f} msg/s"
            f" | manual-mode grant p50 {r['manual_grant_p50_ms']:.3f} ms "
            f"p99 {r['manual_grant_p99_ms']:.3f} ms"
            f" | grant with a busy owner thread p50 {r['busy_owner_grant_p50_ms']:.3f} ms "
            f"p99 {r['busy_owner_grant_p99_ms']:.3f} ms"
        )
    out = {k: round(v, 4) for k, v in idle.items()}
    out.update({f"load_{k}": round(v, 4) for k, v in load.items()})
    out["cpus"] = os.cpu_count()
    out["loadavg"] = round(loadavg, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
