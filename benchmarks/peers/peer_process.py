"""Drive a simulated agent process (sim.py) from tests and benchmarks: start it, send
commands, wait for events with deadlines, and always end it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time


class PeerProcess:
    def __init__(self, rendezvous_dir: str, agent_id: str, *args: str, stderr=None) -> None:
        self.agent_id = agent_id
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.peers.control_peer",
            "--agent-id",
            agent_id,
            "--rendezvous-dir",
            rendezvous_dir,
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr if stderr is not None else subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self.events: list[dict] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.ready = self.wait_for(lambda e: e["ev"] == "ready", 20.0)
        except TimeoutError:
            self.kill()
            raise
        self.epoch = self.ready["epoch"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._cv:
                self.events.append(event)
                self._cv.notify_all()

    def send(self, op: str, **fields) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def wait_for(self, pred, timeout: float, start: int = 0) -> dict:
        """First event (from index ``start``) matching ``pred``; TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for e in self.events[start:]:
                    if pred(e):
                        return e
                start = len(self.events)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{self.agent_id}: no matching event in {timeout}s; "
                        f"last: {self.events[-3:]}"
                    )
                self._cv.wait(min(left, 0.1))

    def ask(self, op: str, reply: str, timeout: float = 10.0, **fields) -> dict:
        """Send a command and wait for the reply event that follows it."""
        with self._cv:
            start = len(self.events)
        self.send(op, **fields)
        return self.wait_for(lambda e: e["ev"] == reply, timeout, start)

    def status(self) -> dict:
        return self.ask("status", "status")

    def status_until(self, pred, timeout: float = 10.0) -> dict:
        """Ask for status until ``pred(status)`` holds; TimeoutError at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if pred(st):
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.agent_id}: status never matched; last {st}")
            with self._cv:  # re-ask when the process says something, at least every 20 ms
                self._cv.wait(0.02)

    def violations(self) -> list[dict]:
        with self._cv:
            return [e for e in self.events if e["ev"] in ("violation", "error")]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(10)

    def close(self) -> None:
        """Quit politely, then kill if it does not exit."""
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        self.kill()


class SimGroup:
    """Simulated agents sharing one short-named rendezvous directory; ``close()`` ends them all."""

    def __init__(self) -> None:
        import tempfile

        self.root = tempfile.mkdtemp(prefix="swc")
        self.rdv = f"{self.root}/r"
        self.procs: list[PeerProcess] = []

    def start(self, agent_id: str, *args: str, rdv: str | None = None) -> PeerProcess:
        log = open(f"{self.root}/{agent_id}.{len(self.procs)}.log", "w")
        try:
            proc = PeerProcess(rdv or self.rdv, agent_id, *args, stderr=log)
        finally:
            log.close()  # the child keeps its own descriptor
        self.procs.append(proc)
        return proc

    def log(self, proc: PeerProcess) -> str:
        i = self.procs.index(proc)
        with open(f"{self.root}/{proc.agent_id}.{i}.log") as f:
            return f.read()

    def close(self) -> None:
        import shutil

        for proc in self.procs:
            proc.close()
            try:  # a killed donor leaves its arena behind
                os.unlink(f"/dev/shm/swc-{proc.agent_id}-{proc.proc.pid}")
            except FileNotFoundError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
