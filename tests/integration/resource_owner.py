"""A process that owns SwiftCache node resources, for test_private_resources.py.

    python tests/integration/resource_owner.py --role donor|borrower --rendezvous-dir DIR

A donor lends a real `SharedArena` (POSIX shared memory) through a control agent; a borrower
borrows from it and maps the arena. Each prints one JSON line when ready (its pid, endpoint and,
for the donor, the shared-memory name), then waits for a signal: the test kills it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from benchmarks.peers.block_region import lend_blocks
from sglang_swift.control import ControlAgent, ControlConfig, LeaseGranted
from sglang_swift.dataplane.sharing import map_arena


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("donor", "borrower"), required=True)
    ap.add_argument("--rendezvous-dir", required=True)
    args = ap.parse_args()
    cfg = ControlConfig(args.role, rendezvous_dir=args.rendezvous_dir, heartbeat_interval_s=0.1)
    ready = {"pid": os.getpid()}
    if args.role == "donor":
        arena, descriptor = lend_blocks(8, 512)
        agent = ControlAgent(cfg, memory=descriptor).start()
        agent.offer(range(8))
        ready["shm"] = arena.export()["handle"].decode()
    else:
        agent = ControlAgent(cfg).start()
        if not agent.wait_until(lambda a: any(q.lendable for q in a.peers.values()), 30):
            sys.exit("no donor showed up")
        agent.request(4)
        event = agent.next_event(30)
        while event is not None and not isinstance(event, LeaseGranted):
            event = agent.next_event(30)
        if event is None:
            sys.exit("no grant")
        mapped = map_arena(event.memory)  # held (mapped) until the process is killed
        ready["mapped"] = mapped.descriptor["handle"].decode()
    ready["endpoint"] = agent.endpoint
    print(json.dumps(ready), flush=True)
    signal.pause()  # until the test kills us


if __name__ == "__main__":
    main()
