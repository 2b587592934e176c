"""How long a live control agent can go unheard on this machine: the numbers behind the
liveness defaults (docs/liveness.md).

A donor runs in its own process (the simulated agent); a borrower agent runs in this process,
beside a main thread that plays the scheduler. Each phase lends the borrower a lease for
``--seconds`` while the machine is:
  idle     nothing else of ours runs;
  cpu      one pure-Python spinning process per core, twice over (a starved CPU);
  torch    two processes running torch matmuls on all cores (OpenMP threads that spin);
  gil      our main thread spins in Python (the agent's thread waits for the interpreter lock);
  gc       our main thread runs full garbage collections of a heap of 4M objects (a collection
           holds the interpreter lock throughout, as in a scheduler with a large heap);
  all      gil + cpu + torch together.
Printed per phase: the longest gap between two messages the donor got from the borrower (what
the donor's death verdict sees), the longest the borrower went without hearing the donor, the
borrower agent's longest own pause, and whether the lease survived. ``old_would_drop`` says
whether the previous liveness would have dropped the lease: it did as soon as any of these gaps
passed 0.75 s (the borrower's read deadline was 1 s heartbeat timeout - 0.25 s margin after the
last echo, and the donor declared it dead after 1 s). The last line is JSON.

    python scripts/bench_liveness.py [--seconds 20] [--phases idle,cpu,torch,gil,gc,all]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

from benchmarks.peers.peer_process import SimGroup
from sglang_swift.control import ControlAgent, ControlConfig, LeaseGranted, LeaseLost

OLD_VALIDITY_S = 0.75  # heartbeat_timeout_s (1.0) - lease_margin_s (0.25), before re-validation
HOGS = {
    "cpu": [[sys.executable, "-c", "while True: pass"]] * (2 * (os.cpu_count() or 1)),
    "gc": [],
    "torch": [
        [
            sys.executable,
            "-c",
            "import torch\na = torch.randn(768, 768)\nwhile True: a @ a",
        ]
    ]
    * 2,
}


def run_phase(group: SimGroup, donor, name: str, seconds: float) -> dict:
    hogs = []
    for part in ("cpu", "torch"):
        if name in (part, "all"):
            hogs += [subprocess.Popen(cmd) for cmd in HOGS[part]]
    agent = ControlAgent(ControlConfig(f"b-{name}", rendezvous_dir=group.rdv)).start()
    try:
        if not agent.wait_until(lambda a: "donor" in a.peers and a.peers["donor"].lendable, 30):
            raise RuntimeError("the donor never showed up")
        agent.request(8, donor="donor")
        events = [agent.next_event(30)]
        while events[-1] is not None and not isinstance(events[-1], LeaseGranted):
            events.append(agent.next_event(30))
        if events[-1] is None:
            raise RuntimeError(f"no lease: {events}")
        if name in ("gil", "all"):
            _spin_gil_for(seconds)
        elif name == "gc":
            _collect_for(seconds)
        else:
            time.sleep(seconds)  # the phase itself: load runs, agents heartbeat
        events += agent.poll_events()
        seen = donor.status()
        mine = agent.status()
        gap_at_donor = max(
            (q["max_silence_ms"] for q in seen["peers"] if q["agent_id"] == f"b-{name}"),
            default=-1,
        )
        return {
            "phase": name,
            "donor_max_gap_ms": gap_at_donor,
            "borrower_max_gap_ms": mine.counters.get("max_silence_ms", 0),
            "borrower_own_pause_ms": mine.counters.get("max_own_pause_ms", 0),
            "revalidated": mine.counters.get("leases_revalidated", 0),
            "lease_kept": not any(isinstance(e, LeaseLost) for e in events) and bool(mine.leases),
            "old_would_drop": max(
                gap_at_donor,
                mine.counters.get("max_silence_ms", 0),
                mine.counters.get("max_own_pause_ms", 0),
            )
            / 1000
            > OLD_VALIDITY_S,
        }
    finally:
        agent.stop()
        for hog in hogs:
            hog.kill()
            hog.wait()


def _spin_gil_for(seconds: float) -> None:
    """A scheduler-like Python loop on the main thread: it holds the interpreter lock as much
    as CPython lets it (the agent's thread gets it back every switch interval, 5 ms)."""
    end, x = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for i in range(100_000):
            x ^= i


def _collect_for(seconds: float) -> None:
    heap = [{"i": i, "l": [i]} for i in range(2_000_000)]  # about 4M tracked objects
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        gc.collect()
    del heap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--phases", default="idle,cpu,torch,gil,gc,all")
    args = ap.parse_args()
    group = SimGroup()
    rows = []
    try:
        donor = group.start("donor", "--donate", "64")
        for name in args.phases.split(","):
            row = run_phase(group, donor, name, args.seconds)
            rows.append(row)
            print(
                f"{name:6s} donor saw a gap of {row['donor_max_gap_ms']:6d} ms, borrower "
                f"{row['borrower_max_gap_ms']:6d} ms, own pause {row['borrower_own_pause_ms']:6d}"
                f" ms; lease kept {row['lease_kept']}; old liveness would drop it: "
                f"{row['old_would_drop']}",
                flush=True,
            )
    finally:
        group.close()
    print(json.dumps({"seconds": args.seconds, "loadavg": os.getloadavg()[0], "phases": rows}))


if __name__ == "__main__":
    main()
