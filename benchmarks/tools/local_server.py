"""Start and stop a real `python -m sglang.launch_server` on 127.0.0.1 (demo, tests, benchmarks).

`cpu` says how the server picks its engine:
- None (default): as the venv would for a plain `launch_server` (`cpu_compat.engine_choice`: the CPU
  engine when no accelerator is found), then as True or False;
- True: SGLang's CPU engine, forced explicitly (`cpu_compat.cpu_env` and CPU_ARGS);
- False: nothing added; the environment and flags are passed as they are (a GPU machine, or the
  CPU venv's own automatic choice, which is what a new user gets).
The server runs in its own process group and is always killed on exit, even if start-up fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

from sglang_swift.cpu_compat import cpu_env
from sglang_swift.cpu_compat.engine_choice import choose_engine

# --sleep-on-idle: an idle SGLang scheduler otherwise polls its sockets without pause, a whole core
# each; on a 2-core machine a server starting beside two idle ones takes several times as long
# (about 90 s instead of 25)
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--skip-server-warmup",
            "--sleep-on-idle")


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message holds its log tail."""


BIND_RETRIES = 2  # starts again on a fresh port when the chosen one was taken meanwhile


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """A context manager around one SGLang server process; `base_url` is valid inside it."""

    def __init__(self, model_path: str | os.PathLike, *, swiftcache: bool = True,
                 extra_args: Sequence[str] = (), port: int | None = None, cpu: bool | None = None,
                 max_total_tokens: int | None = 4096, log_path: str | os.PathLike | None = None,
                 startup_timeout_s: float = 240.0, env: dict[str, str] | None = None) -> None:
        self.model_path = str(model_path)
        self._port_given = port is not None
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        base = dict(os.environ if env is None else env)
        if cpu is None:  # decided here, without probing anything when the environment already says
            cpu = choose_engine(base, list(extra_args)).cpu_engine
        self.swiftcache = swiftcache
        self.cpu = cpu
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/sglang-server-{self.port}.log")
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
                "--host", "127.0.0.1", "--port", str(self.port)]
        if max_total_tokens is not None:
            args += ["--max-total-tokens", str(max_total_tokens)]
        if cpu:
            args += CPU_ARGS
        if swiftcache:
            args.append("--enable-swiftcache")
        self.args = args + list(extra_args)
        self.env = cpu_env(base) if cpu else base
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "LocalServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until it is healthy. A port this object chose (`free_port`)
        can be taken by another process before the server binds it (servers started side by
        side, SGLang's own internal ports): the server then exits with "address already in use",
        and it is started again on a fresh port, at most BIND_RETRIES times."""
        for attempt in range(BIND_RETRIES + 1):
            try:
                return self._start_once()
            except ServerStartError:
                lost_port = "address already in use" in self.log_tail(200)
                if self._port_given or not lost_port or attempt == BIND_RETRIES:
                    raise
                self._move_to(free_port())

    def _move_to(self, port: int) -> None:
        at = self.args.index("--port") + 1
        self.args[at] = str(port)
        self.port, self.base_url = port, f"http://127.0.0.1:{port}"

    def _start_once(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        try:
            self._wait_healthy(t0 + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self._freeze_gc()

    def _freeze_gc(self) -> None:
        """SGLang's own last start-up step, done once the server listens: after its warm-up it
        posts /freeze_gc to itself (`_freeze_gc_after_server_warmup`), so the start-up objects
        of every process leave the garbage collector's generations; with --skip-server-warmup
        (CPU_ARGS) that post runs before the HTTP server listens and fails ("post-warmup
        freeze_gc failed"), and a full collection of those objects (0.4 s here) then stalls
        whichever early request it meets. Best effort, as SGLang's own."""
        try:
            req = urllib.request.Request(self.base_url + "/freeze_gc", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)  # polling interval while the server boots, not a synchronisation
        raise ServerStartError(f"server not healthy after {self.startup_timeout_s:.0f}s:\n"
                               f"{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children (scheduler, detokenizer) share the group; make sure none survive
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    # -- helpers -----------------------------------------------------------------------------
    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, payload: dict, timeout: float = 120.0) -> dict:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())


def start_all(servers) -> None:
    """Start the servers side by side (each start blocks until healthy; start-up is mostly
    imports, on every core); raise the first failure after every attempt ended."""
    errors: list[BaseException] = []

    def start(server: LocalServer) -> None:
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the join
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@contextmanager
def starting(*servers: LocalServer) -> Iterator[Callable[[], None]]:
    """The servers start side by side in the background (`start_all` on a thread) while the
    block does something else, such as a stock reference replay; the block calls the `ready()`
    it is given to wait until every one is healthy (it raises the first start-up failure).
    However the block ends, a start still in progress ends first, then every server stops."""
    errors: list[BaseException] = []

    def start() -> None:
        try:
            start_all(servers)
        except BaseException as exc:  # noqa: BLE001 - raised by ready(), on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()

    def ready() -> None:
        thread.join()
        if errors:
            raise errors[0]

    try:
        yield ready
    finally:
        thread.join()
        for server in servers:
            server.stop()


@contextmanager
def serving(*servers: LocalServer) -> Iterator[tuple[LocalServer, ...]]:
    """The servers started side by side for the length of the block, then stopped."""
    with starting(*servers) as ready:
        ready()
        yield servers
