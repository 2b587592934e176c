"""A standalone agent process for tests, benchmarks and operators trying the channel without
a model server: ``python -m benchmarks.peers.control_peer --agent-id a --rendezvous-dir DIR ...``.

It speaks JSON lines: commands on stdin (``{"op": "request", "n": 4}``), events on stdout
(``{"ev": "LeaseGranted", "t": <monotonic>, ...}``). A donor lends a real shared-memory
region (``SharedArena``, the data plane's own, in ``/dev/shm``; borrowers map it with
``map_arena`` from the grant's descriptor, as a server does); every block starts with an
8-byte *claim* word that borrowers set while they hold the block and clear before releasing or
acknowledging. So:

* a donor that gets a block back whose claim word is set was handed a block still in use
  (``violation`` event); a borrower granted a block whose claim word is set got a block
  granted twice (``violation``);
* ``--readers K`` runs K threads that keep reading held blocks and check the payload the
  borrower wrote; a donor with ``--scribble`` overwrites every block it gets back, so a block
  reused before the borrower stopped reading shows up as a ``violation``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time

import msgspec

from benchmarks.peers.block_region import lend_blocks
from benchmarks.peers.peer_borrower import PeerBorrower
from sglang_swift.control import events as ev
from sglang_swift.control.agent import ControlAgent
from sglang_swift.control.control_config import ControlConfig
from sglang_swift.dataplane import SharedArena, map_arena

_out_lock = threading.Lock()


def say(kind: str, **fields) -> None:
    line = json.dumps({"ev": kind, "t": time.monotonic(), **fields})
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class Blocks:
    """A region's blocks as one flat, writable byte buffer (`buf`): the donor's own
    `SharedArena`, or a borrower's mapping of it (`map_arena`)."""

    def __init__(self, memory) -> None:
        self.buf = memoryview(memory.numpy()).cast("B")

    @classmethod
    def lend(cls, num_blocks: int, block_bytes: int) -> tuple[Blocks, SharedArena, dict]:
        arena, descriptor = lend_blocks(num_blocks, block_bytes, name_prefix="swc")
        return cls(arena.memory), arena, descriptor


class Mapper:
    """The borrower's `arena_cls`: maps a donor's region by its handle, from the descriptor of
    the grant that named it (`remember` sees every event before the borrower does)."""

    def __init__(self) -> None:
        self.descriptors: dict[bytes, object] = {}
        self.mapped: list = []

    def remember(self, e) -> None:
        if isinstance(e, ev.LeaseGranted):
            self.descriptors[e.memory.handle] = e.memory

    def __call__(self, name: str) -> Blocks:
        mapped = map_arena(self.descriptors[name.encode()])
        self.mapped.append(mapped)
        return Blocks(mapped.memory)


class SimDonor:
    def __init__(self, agent: ControlAgent, args) -> None:
        self.agent, self.args = agent, args
        self.blocks, self.arena, descriptor = Blocks.lend(args.donate, args.block_bytes)
        agent.set_memory(descriptor)
        agent.offer(range(args.donate))
        if args.pressure:
            threading.Thread(target=self._pressure, daemon=True).start()

    def _pressure(self) -> None:
        """The owner's own demand comes and goes: take back a few blocks every 20 ms."""
        rng = random.Random(os.getpid())
        while True:
            self.agent.demand(rng.randint(1, self.args.pressure))
            time.sleep(0.02)  # pacing the simulated owner, not waiting for anything

    def on_event(self, e) -> None:
        if not isinstance(e, ev.BlocksReturned):
            return
        bb, buf = self.args.block_bytes, self.blocks.buf
        claimed = [b for b in e.blocks if buf[b * bb : b * bb + 8] != bytes(8)]
        if claimed:
            say("violation", what="returned block still claimed", blocks=claimed[:16])
        if self.args.scribble:
            for b in e.blocks:
                buf[b * bb + 8 : (b + 1) * bb] = b"\xee" * (bb - 8)
        if self.args.reoffer:
            self.agent.offer(e.blocks)


def _break_reclaims(agent: ControlAgent) -> None:
    """Negative control: a donor that treats every reclaim as acknowledged at once, i.e.
    reuses blocks while the borrower may still hold them. The checks must catch it."""
    ledger = agent.donor.ledger
    start = ledger.start_reclaims

    def start_and_forget(n):
        recs = start(n)
        for rec in recs:
            agent.donor._returned(ledger.ack(rec.borrower, rec.reclaim_id, rec.lease_id))
        return recs

    ledger.start_reclaims = start_and_forget


def _event_fields(e) -> dict:
    out = {}
    for k, v in vars(e).items():
        if isinstance(v, ev.LeaseKey):
            v = list(v)
        elif hasattr(v, "__struct_fields__"):
            continue
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def run(args) -> None:
    cfg = ControlConfig(
        agent_id=args.agent_id,
        rendezvous_dir=args.rendezvous_dir,
        secret_file=args.secret_file,
        heartbeat_interval_s=args.heartbeat_timeout / 10,
        heartbeat_timeout_s=args.heartbeat_timeout,
        lease_margin_s=args.heartbeat_timeout / 4,
        reserve_blocks=args.reserve,
        policy=args.policy,
        max_blocks_per_borrower=args.cap,
        reclaim_deadline_s=args.reclaim_deadline,
    )
    agent = ControlAgent(cfg, model=args.model)
    if args.unsafe_early_return:
        _break_reclaims(agent)
    agent.start()
    donor = SimDonor(agent, args) if args.donate else None
    mapper = Mapper()
    borrower = PeerBorrower(agent, args, say, mapper)
    say(
        "ready", agent_id=args.agent_id, epoch=agent.epoch, endpoint=agent.endpoint, pid=os.getpid()
    )
    stop = threading.Event()

    def pump() -> None:
        while not stop.is_set():
            e = agent.next_event(0.05)
            if e is None:
                continue
            try:
                if donor:
                    donor.on_event(e)
                mapper.remember(e)
                borrower.on_event(e)
            except Exception as exc:  # keep pumping; the test sees the error line
                logging.exception("sim event handler failed")
                say("error", detail=f"{type(exc).__name__}: {exc}")
            if not args.quiet_events or isinstance(e, (ev.PeerChanged, ev.LeaseLost)):
                say(type(e).__name__, **_event_fields(e))

    threading.Thread(target=pump, daemon=True).start()
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "quit":
                break
            if op == "status":
                say("status", **msgspec.to_builtins(agent.status()))
            elif op == "integrity":
                try:
                    agent.check_integrity()
                    say("integrity", ok=True)
                except AssertionError as exc:
                    say("integrity", ok=False, error=str(exc))
            elif op == "demand":
                agent.demand(cmd["n"])
            elif op == "offer":
                agent.offer(cmd["blocks"])
            else:
                borrower.command(op, cmd)
    finally:
        stop.set()
        borrower.stop()
        agent.stop()
        if donor:
            donor.blocks = None
            donor.arena.close()
        say("exited")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agent-id", required=True)
    ap.add_argument("--rendezvous-dir", required=True)
    ap.add_argument("--secret-file", default="")
    ap.add_argument("--model", default="sim")
    ap.add_argument("--donate", type=int, default=0, help="blocks to lend (0: borrower only)")
    ap.add_argument("--block-bytes", type=int, default=512,
                    help="a multiple of BLOCK_ALIGN_BYTES (512)")
    ap.add_argument("--reserve", type=int, default=0)
    ap.add_argument("--cap", type=int, default=0)
    ap.add_argument("--policy", default="proportional")
    ap.add_argument("--heartbeat-timeout", type=float, default=1.0)
    ap.add_argument("--reclaim-deadline", type=float, default=0.5)
    ap.add_argument("--scribble", action="store_true", help="overwrite blocks we get back")
    ap.add_argument("--reoffer", action="store_true", help="lend blocks again once back")
    ap.add_argument("--auto-ack", action="store_true", help="acknowledge reclaims at once")
    ap.add_argument("--pressure", type=int, default=0, help="donor demands up to N blocks / 20 ms")
    ap.add_argument(
        "--unsafe-early-return",
        action="store_true",
        help="negative control: donor reuses reclaimed blocks before the ack",
    )
    ap.add_argument(
        "--unsafe-ack-early",
        action="store_true",
        help="negative control: ack reclaims before readers stop (must be caught)",
    )
    ap.add_argument("--readers", type=int, default=0, help="reader threads over held blocks")
    ap.add_argument("--quiet-events", action="store_true")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s {args.agent_id} %(levelname)s %(name)s: %(message)s",
    )
    run(args)


if __name__ == "__main__":
    main()
