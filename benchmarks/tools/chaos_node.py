"""The servers of a chaos run and the faults done to them: start, freeze, kill, restart, read.

A `ChaosNode` owns one busy borrower (the `small` model), donors (the `tiny` model) and, for the
reference, a stock SGLang server on the borrower's model with the borrower's pool. Every server
runs in its own process group (LocalServer), so a fault reaches the launcher, the scheduler (where
the SwiftCache agent lives) and the detokenizer at once. `close()` thaws and kills everything it
started, whatever happened.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

from sglang_swift.control import discovery
from sglang_swift.control import protocol as p
from sglang_swift.control.auth import read_secret
from sglang_swift.ctl import query

from .local_server import LocalServer

SERVER_ARGS = ["--enable-cache-report", "--dtype", "float32", "--enable-metrics"]


def read_metrics(server: LocalServer, prefix: str = "swiftcache_") -> dict[str, float]:
    """Samples of `server`'s /metrics whose name starts with `prefix`, summed over labels."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_until(predicate: Callable[[], object], timeout_s: float) -> object:
    """Poll another process's state until `predicate()` is truthy; its last value otherwise."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(0.25)  # polling servers we do not control, not a synchronisation
        value = predicate()
    return value


class ChaosNode:
    """The chaos run's servers; names: "borrower", "donor0", "donor1", ... and "stock"."""

    def __init__(self, borrower_model: Path, donor_model: Path, *, donors: int, out: Path,
                 pool_tokens: int, donor_pool_tokens: int, max_borrow_blocks: int,
                 heartbeat_timeout_s: float, heartbeat_interval_s: float) -> None:
        self.out = out
        # a short private dir: an ipc socket path must fit 107 bytes, and `out` may be deep
        self.rendezvous = tempfile.mkdtemp(prefix="swift-chaos-")
        self.donor_model = donor_model
        self.donor_pool_tokens = donor_pool_tokens
        self.common = [*SERVER_ARGS, "--swiftcache-rendezvous-dir", self.rendezvous,
                       "--swiftcache-heartbeat-timeout-s", str(heartbeat_timeout_s),
                       "--swiftcache-heartbeat-interval-s", str(heartbeat_interval_s)]
        self.servers: dict[str, LocalServer] = {
            "stock": LocalServer(borrower_model, swiftcache=False, max_total_tokens=pool_tokens,
                                 extra_args=SERVER_ARGS, log_path=out / "stock.log"),
            "borrower": LocalServer(borrower_model, max_total_tokens=pool_tokens,
                                    log_path=out / "borrower.log", extra_args=[
                                        *self.common, "--swiftcache-role", "borrower",
                                        "--swiftcache-max-borrow-blocks", str(max_borrow_blocks)]),
        }
        for i in range(donors):
            self.servers[f"donor{i}"] = self._donor(f"donor{i}", out / f"donor{i}.log")
        self.retired: list[LocalServer] = []  # killed incarnations, kept for their logs
        self.frozen: set[str] = set()
        self._codec: p.Codec | None = None

    def _donor(self, name: str, log_path: Path) -> LocalServer:
        # Watermark 0.5: the donor keeps half its pool free for itself, so a burst of its own
        # reclaims. It lends 0.4, not 0.5: lending right down to the reserve would make its first
        # own token (SGLang's /health probe is a 1-token prefill) reclaim everything at start-up.
        return LocalServer(self.donor_model, max_total_tokens=self.donor_pool_tokens,
                           log_path=log_path, extra_args=[
                               *self.common, "--swiftcache-role", "donor",
                               "--swiftcache-lend-fraction", "0.4",
                               "--swiftcache-reclaim-watermark", "0.5"])

    @property
    def donors(self) -> list[str]:
        return [n for n in self.servers if n.startswith("donor")]

    # ---- lifecycle ------------------------------------------------------------------------
    @contextlib.contextmanager
    def starting(self) -> Iterator[dict[str, cf.Future]]:
        """Start every server at once; the block gets each one's start future (use a server
        as soon as its own is done) and leaves only when all are up (raising if one failed)."""
        with cf.ThreadPoolExecutor(len(self.servers)) as pool:
            futures = {name: pool.submit(s.start) for name, s in self.servers.items()}
            try:
                yield futures
            except BaseException:
                for name in self.servers:  # do not wait for the others to come up
                    threading.Thread(target=self.servers[name].stop, daemon=True).start()
                raise
            for future in futures.values():
                future.result()

    def stop(self, name: str) -> None:
        self.servers[name].stop()

    def close(self) -> None:
        for name in list(self.frozen):
            self.thaw(name)
        for server in [*self.servers.values(), *self.retired]:
            server.stop()
        shutil.rmtree(self.rendezvous, ignore_errors=True)

    # ---- faults ---------------------------------------------------------------------------
    def _signal(self, name: str, sig: int) -> None:
        os.killpg(self.servers[name].proc.pid, sig)

    def freeze(self, name: str) -> None:
        self._signal(name, signal.SIGSTOP)
        self.frozen.add(name)

    def thaw(self, name: str) -> None:
        self._signal(name, signal.SIGCONT)
        self.frozen.discard(name)

    def thaw_after(self, name: str, seconds: float) -> threading.Thread:
        """SIGCONT `name` `seconds` from now, from a thread (requests may block meanwhile)."""
        def run() -> None:
            time.sleep(seconds)  # the length of the freeze: the fault itself
            self.thaw(name)

        thread = threading.Thread(target=run, name=f"thaw-{name}", daemon=True)
        thread.start()
        return thread

    def kill(self, name: str) -> None:
        server = self.servers[name]
        self._signal(name, signal.SIGKILL)
        server.proc.wait(30)
        server.stop()  # reaps what is left of the group

    def restart(self, name: str) -> None:
        """A new incarnation of a killed donor on the same rendezvous dir (a new port: a new
        agent id; the node sees one donor gone and another one come)."""
        old = self.servers[name]
        self.retired.append(old)
        n = sum(1 for s in self.retired if s.log_path.name.startswith(name))
        self.servers[name] = self._donor(name, self.out / f"{name}-restart{n}.log")
        self.servers[name].start()

    def burst(self, name: str, n: int = 3, max_tokens: int = 48, timeout_s: float = 300) -> None:
        """The donor's own traffic: `n` concurrent long prompts needing most of its free room."""
        server = self.servers[name]
        prompt = " ".join(f"word{i}" for i in range(300))
        payload = {"model": "donor", "messages": [{"role": "user", "content": prompt}],
                   "max_tokens": max_tokens, "temperature": 0.0}
        with cf.ThreadPoolExecutor(n) as pool:
            for future in [pool.submit(server.post, "/v1/chat/completions", payload, timeout_s)
                           for _ in range(n)]:
                future.result()

    # ---- what the servers say -------------------------------------------------------------
    def agent_id(self, name: str) -> str:
        """The agent id a SwiftCache server announces (`<model dir>-<port>`, backend.py)."""
        server = self.servers[name]
        return f"{Path(server.model_path).name}-{server.port}"

    def status(self, name: str, timeout_s: float = 2.0) -> p.AgentStatus | None:
        """`ctl status` of one server's agent (never ask a frozen one), or None."""
        if self._codec is None:
            self._codec = p.Codec(read_secret(os.path.join(self.rendezvous, "secret")))
        agent = self.agent_id(name)
        for rec in discovery.read_records(self.rendezvous):
            if rec.agent_id == agent:
                reply = query(self._codec, rec, timeout_s)
                return reply if isinstance(reply, p.AgentStatus) else None
        return None

    def leases_from(self, donor: str) -> list[p.LeaseStatus]:
        """The borrower's leases from `donor`'s current incarnation."""
        st = self.status("borrower")
        agent = self.agent_id(donor)
        return [ls for ls in (st.leases if st else []) if ls.donor == agent]
