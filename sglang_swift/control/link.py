"""Sockets of one agent: a ROUTER bound at its own endpoint receives; one DEALER per peer
endpoint sends. Replies to non-peers (errors, `ctl` status) go back through the ROUTER.
Used from the agent's I/O thread only (ZMQ sockets are not thread-safe).

Each DEALER is monitored, so the agent knows when the connection to a peer is closed: a peer
whose process exited has no listening socket, and ZMQ cannot reconnect to it (``closed_for``).
An ipc socket file is made 0600 and removed on close (or by a sweep, see discovery.sweep).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from sglang_swift.control import protocol as p

log = logging.getLogger(__name__)


class BadMessageLog:
    """Logs every refused frame, but at most ``burst`` lines a second; the rest are summed up
    per reason once a second, so a flood can neither drown the log nor slow the agent much."""

    def __init__(self, burst: int = 20) -> None:
        self.burst, self._window, self._logged = burst, 0.0, 0
        self._suppressed: dict[str, int] = {}

    def __call__(self, code: str, detail: str, source: str) -> None:
        self.tick(time.monotonic())
        if self._logged < self.burst:
            self._logged += 1
            log.warning("refused message from %s: %s: %s", source, code, detail)
        else:
            self._suppressed[code] = self._suppressed.get(code, 0) + 1

    def tick(self, now: float) -> None:
        if now - self._window < 1.0:
            return
        if self._suppressed:
            log.warning(
                "refused %d more messages since the last report: %s",
                sum(self._suppressed.values()),
                self._suppressed,
            )
            self._suppressed = {}
        self._window, self._logged = now, 0


class Link:
    def __init__(self, codec: p.Codec, endpoint: str, max_bytes: int) -> None:
        self.codec = codec
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self.router.setsockopt(zmq.RCVHWM, 10000)
        if endpoint.startswith("ipc://"):
            try:
                os.unlink(endpoint[len("ipc://") :])  # left by a killed predecessor
            except FileNotFoundError:
                pass
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = self.router.bind_to_random_port(endpoint.rsplit(":", 1)[0])
            endpoint = f"{endpoint.rsplit(':', 1)[0]}:{port}"
        else:
            self.router.bind(endpoint)
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://") :], 0o600)  # the directory is 0700 as well
        self.endpoint = endpoint
        self.dealers: dict[str, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, str] = {}  # monitor socket -> dealer endpoint
        self._closed_since: dict[str, float] = {}  # endpoint -> monotonic time it dropped
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self._wake_r.fileno(), zmq.POLLIN)
        self.dropped = 0

    def dealer(self, endpoint: str) -> zmq.Socket:
        sock = self.dealers.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.codec.max_bytes)
            sock.setsockopt(zmq.SNDHWM, 10000)
            # Watch before connecting, or the first EVENT_CONNECTED may come unseen.
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError:
                sock.disable_monitor()
                monitor.close(0)
                sock.close(0)
                raise
            self.dealers[endpoint] = sock
            self.poller.register(sock, zmq.POLLIN)
            self._monitors[monitor] = endpoint
            self.poller.register(monitor, zmq.POLLIN)
            self._closed_since[endpoint] = time.monotonic()  # until the first connect
        return sock

    def closed_for(self, endpoint: str, now: float) -> float:
        """Seconds the connection to `endpoint` has been down (never up counts from the first
        send); 0.0 while it is up or when we never sent there."""
        since = self._closed_since.get(endpoint)
        return 0.0 if since is None else max(0.0, now - since)

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        endpoint = self._monitors[monitor]
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_CONNECTED:
                self._closed_since.pop(endpoint, None)
            elif event == zmq.EVENT_DISCONNECTED:
                self._closed_since.setdefault(endpoint, time.monotonic())

    def close_dealer(self, endpoint: str, linger_ms: int = 0) -> None:
        sock = self.dealers.pop(endpoint, None)
        if sock is not None:
            for monitor in [m for m, ep in self._monitors.items() if ep == endpoint]:
                self.poller.unregister(monitor)
                del self._monitors[monitor]
                sock.disable_monitor()
                monitor.close(0)
            self._closed_since.pop(endpoint, None)
            self.poller.unregister(sock)
            sock.close(linger_ms)

    def send(self, endpoint: str, env: p.Envelope) -> None:
        try:
            self.dealer(endpoint).send(self.codec.encode(env), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1  # peer not draining: heartbeats will settle its fate
        except zmq.ZMQError as exc:
            self.dropped += 1
            log.warning("cannot send to %s: %s", endpoint, exc)

    def reply(self, routing_id: bytes, env: p.Envelope) -> None:
        try:
            self.router.send_multipart([routing_id, self.codec.encode(env)], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            self.dropped += 1

    def wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already pending

    def poll(self, timeout_s: float):
        """Yield (frames, routing_id or None, source) for up to a batch of ready messages."""
        ready = dict(self.poller.poll(max(0, math.ceil(timeout_s * 1000))))  # no 0 ms spins
        if self._wake_r.fileno() in ready:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        for sock in ready:
            if not isinstance(sock, zmq.Socket) or sock.closed:
                continue
            if sock in self._monitors:
                self._on_monitor(sock)
                continue
            for _ in range(256):
                if sock.closed:
                    break
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                if sock is self.router:
                    yield frames[1:], frames[0], "router"
                else:
                    yield frames, None, "dealer"

    def close(self, linger_ms: int = 0) -> None:
        for ep in list(self.dealers):
            self.close_dealer(ep, linger_ms)
        self.router.close(0)
        self._wake_r.close()
        self._wake_w.close()
        self.ctx.term()
        if self.endpoint.startswith("ipc://"):
            try:
                os.unlink(self.endpoint[len("ipc://") :])
            except FileNotFoundError:
                pass
