"""The borrower half of the simulated agent (see sim.py): claims, readers, churn."""

from __future__ import annotations

import os
import random
import struct
import threading
import time

from benchmarks.peers.block_region import block_size
from sglang_swift.control import events as ev

_CLAIM = struct.Struct("<II")  # holder pid, lease id (low 32 bits); zero means unclaimed


def _pattern(lease_id: int, block: int) -> int:
    return (lease_id * 131 + block) % 200 + 1


def _claim_alive(word: bytes) -> bool:
    pid, _ = _CLAIM.unpack(word)
    if pid == 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False  # a killed holder's claim is stale, not a double grant
    return True


class PeerBorrower:
    def __init__(self, agent, args, say, arena_cls) -> None:
        self.agent, self.args, self.say, self._arena_cls = agent, args, say, arena_cls
        self.arenas: dict[bytes, object] = {}
        self.held: dict[ev.LeaseKey, tuple[object, set[int], int]] = {}  # arena, blocks, bytes
        self.pending_reclaims: list[ev.ReclaimRequested] = []
        self.cv = threading.Condition()
        self.readable: list[tuple] = []  # (key, block); rebuilt on change
        self.inuse: dict[tuple, int] = {}
        self.results: dict[int, object] = {}
        self.stats = dict(reads=0, read_violations=0, grants=0, denied=0, releases=0, acks=0)
        self.auto = args.auto_ack or args.readers > 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._reader, daemon=True, args=(i,))
            for i in range(args.readers)
        ]
        for t in self._threads:
            t.start()

    # ---- events (pump thread) ----
    def on_event(self, e) -> None:
        if isinstance(e, ev.LeaseGranted):
            self._granted(e)
        elif isinstance(e, ev.ReclaimRequested):
            if self.args.unsafe_ack_early:
                self.agent.ack_reclaim(e)
                time.sleep(0.02)  # readers keep going after the ack: the bug under test
                self._stop_reading(e.key, set(e.blocks), clear=False)
            elif self.auto:
                self._stop_reading(e.key, set(e.blocks))
                self.agent.ack_reclaim(e)
                self.stats["acks"] += 1
            else:
                self.pending_reclaims.append(e)
        elif isinstance(e, ev.LeaseLost):
            with self.cv:
                self.held.pop(e.key, None)  # never write to lost blocks: someone may own them
                self._rebuild()
        if isinstance(e, (ev.LeaseGranted, ev.RequestFailed)):
            with self.cv:
                self.results[e.request_id] = e
                self.cv.notify_all()

    def _granted(self, e: ev.LeaseGranted) -> None:
        self.stats["grants"] += 1
        arena = self.arenas.get(e.memory.handle)
        if arena is None:
            arena = self.arenas[e.memory.handle] = self._arena_cls(e.memory.handle.decode())
        bb, buf = block_size(e.memory), arena.buf
        taken = [b for b in e.blocks if _claim_alive(buf[b * bb : b * bb + 8])]
        if taken:
            self.say(
                "violation", what="granted block still claimed", blocks=taken[:16], key=list(e.key)
            )
        word = _CLAIM.pack(os.getpid(), e.key.lease_id & 0xFFFFFFFF)
        for b in e.blocks:
            buf[b * bb : b * bb + 8] = word
            if self.args.readers:
                buf[b * bb + 8 : (b + 1) * bb] = bytes([_pattern(e.key.lease_id, b)]) * (bb - 8)
        with self.cv:
            self.held[e.key] = (arena, set(e.blocks), bb)
            self._rebuild()

    def _stop_reading(self, key: ev.LeaseKey, blocks: set[int], clear: bool = True) -> None:
        """Make blocks unreadable, wait for readers inside them, then clear our claim words."""
        with self.cv:
            entry = self.held.get(key)
            if entry is None:
                return
            arena, mine, bb = entry
            mine -= blocks
            if not mine:
                del self.held[key]
            self._rebuild()
            if not self.cv.wait_for(
                lambda: all(self.inuse.get((key, b), 0) == 0 for b in blocks), 5.0
            ):
                self.say("violation", what="reader did not leave a reclaimed block")
        for b in blocks if clear else ():
            arena.buf[b * bb : b * bb + 8] = bytes(8)

    def _rebuild(self) -> None:
        self.readable = [(k, b) for k, (_, bs, _) in self.held.items() for b in bs]

    # ---- readers ----
    def _reader(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            with self.cv:
                if not self.readable:
                    self.cv.wait(0.01)
                    continue
                key, b = rng.choice(self.readable)
                if time.monotonic() >= self.agent.read_deadline(key.donor):
                    continue
                arena, _, bb = self.held[key]
                self.inuse[(key, b)] = self.inuse.get((key, b), 0) + 1
            want = bytes([_pattern(key.lease_id, b)]) * (bb - 8)
            ok = True
            for _ in range(3):  # a read that lasts a while, like a kernel pass
                ok &= arena.buf[b * bb + 8 : (b + 1) * bb] == want
            with self.cv:
                self.inuse[(key, b)] -= 1
                self.stats["reads"] += 1
                if not ok:
                    self.stats["read_violations"] += 1
                self.cv.notify_all()
            if not ok:
                self.say("violation", what="read a reused block", key=list(key), block=b)

    # ---- commands (main thread) ----
    def command(self, op: str, cmd: dict) -> None:
        if op == "request":
            rid = self.agent.request(cmd["n"], cmd.get("priority", 0), cmd.get("donor"))
            self.say("requested", request_id=rid)
        elif op == "ack_pending":
            for e in self.pending_reclaims:
                self._stop_reading(e.key, set(e.blocks))
                self.agent.ack_reclaim(e)
            self.pending_reclaims.clear()
        elif op == "release_all":
            for key in list(self.held):
                self._stop_reading(key, set(self.held[key][1]))
                self.agent.release(key)
                self.stats["releases"] += 1
        elif op == "stats":
            self.say("stats", **self.stats)
        elif op == "churn":
            self.auto = True
            threading.Thread(target=self._churn, args=(cmd,), daemon=True).start()
        else:
            self.say("error", detail=f"unknown op {op}")

    def _churn(self, cmd: dict) -> None:
        """Random requests and releases; each request waits for its grant or refusal."""
        rng = random.Random(cmd.get("seed", 0))
        donors, max_held = cmd["donors"], cmd.get("max_held", 32)
        for _ in range(cmd["ops"]):
            with self.cv:
                n_held = sum(len(bs) for _, bs, _ in self.held.values())
                keys = list(self.held)
            if keys and (n_held >= max_held or rng.random() < 0.4):
                key = rng.choice(keys)
                with self.cv:
                    blocks = set(self.held[key][1]) if key in self.held else set()
                if blocks:
                    self._stop_reading(key, blocks)
                    self.agent.release(key)
                    self.stats["releases"] += 1
                continue
            rid = self.agent.request(rng.randint(1, 8), rng.randint(0, 2), rng.choice(donors))
            with self.cv:
                if not self.cv.wait_for(lambda rid=rid: rid in self.results, 5.0):
                    self.say("violation", what="request never answered", request_id=rid)
                    continue
                res = self.results.pop(rid)
            if isinstance(res, ev.RequestFailed):
                self.stats["denied"] += 1
        self.say("churn_done", **self.stats)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(1.0)
