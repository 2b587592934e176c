"""LocalServer starts again on a fresh port when the port it chose was taken before the server
bound it (servers started side by side race for ports), and only then. `starting` starts
servers in the background while its block works, and stops every one however the block ends."""

from __future__ import annotations

import threading

import pytest

from benchmarks.tools import local_server
from benchmarks.tools.local_server import LocalServer, ServerStartError, serving, starting


def _server(tmp_path, port=None) -> LocalServer:
    return LocalServer(tmp_path, swiftcache=False, cpu=False, port=port,
                       log_path=tmp_path / "server.log")


def _failing_start(server: LocalServer, lines: list[str], tries: list[int]):
    def start_once() -> None:
        tries.append(server.port)
        line = lines[min(len(tries), len(lines)) - 1]
        if line is None:
            return
        server.log_path.write_text(line + "\n")
        raise ServerStartError(line)
    return start_once


def test_a_port_taken_meanwhile_is_replaced_and_the_agent_sees_the_new_one(tmp_path):
    server = _server(tmp_path)
    tries: list[int] = []
    server._start_once = _failing_start(
        server, ["ERROR: [Errno 98] error while attempting to bind on address "
                 "('127.0.0.1', 1): address already in use", None], tries)
    server.start()
    assert len(tries) == 2 and tries[0] != tries[1] == server.port
    assert server.args[server.args.index("--port") + 1] == str(server.port)
    assert server.base_url.endswith(f":{server.port}")


def test_other_start_failures_and_given_ports_are_not_retried(tmp_path):
    server = _server(tmp_path)
    tries: list[int] = []
    server._start_once = _failing_start(server, ["server exited with code 1: bad model"], tries)
    with pytest.raises(ServerStartError):
        server.start()
    assert len(tries) == 1
    given = _server(tmp_path, port=local_server.free_port())
    tries = []
    given._start_once = _failing_start(given, ["address already in use"], tries)
    with pytest.raises(ServerStartError):
        given.start()
    assert len(tries) == 1


def test_a_port_lost_every_time_gives_up_after_the_retries(tmp_path):
    server = _server(tmp_path)
    tries: list[int] = []
    server._start_once = _failing_start(server, ["address already in use"], tries)
    with pytest.raises(ServerStartError):
        server.start()
    assert len(tries) == local_server.BIND_RETRIES + 1


class _Fake:
    """A server whose start waits for `go` (or fails at once), recording what happened."""

    def __init__(self, go: threading.Event, fail: str | None = None):
        self.go, self.fail, self.events = go, fail, []
        self.started = threading.Event()

    def start(self) -> None:
        self.events.append("start")
        self.started.set()
        if self.fail:
            raise ServerStartError(self.fail)
        assert self.go.wait(10)
        self.events.append("healthy")

    def stop(self) -> None:
        self.events.append("stop")


def test_starting_runs_the_block_while_servers_start_and_ready_waits_for_them():
    go = threading.Event()
    servers = [_Fake(go), _Fake(go)]
    with starting(*servers) as ready:
        assert all(s.started.wait(10) for s in servers)  # both starting side by side,
        assert all(s.events == ["start"] for s in servers)  # neither healthy yet
        go.set()  # the block's own work done: now the servers may come up
        ready()
        assert all(s.events == ["start", "healthy"] for s in servers)
    assert all(s.events == ["start", "healthy", "stop"] for s in servers)


def test_a_failed_start_raises_from_ready_and_every_server_still_stops():
    go = threading.Event()
    go.set()
    ok, bad = _Fake(go), _Fake(go, fail="server exited with code 1")
    with pytest.raises(ServerStartError, match="exited with code 1"):
        with serving(ok, bad):
            pytest.fail("the block must not run when a server did not start")
    assert ok.events == ["start", "healthy", "stop"] and bad.events == ["start", "stop"]


def test_a_block_that_raises_stops_the_servers_once_their_start_ended():
    go = threading.Event()
    server = _Fake(go)
    with pytest.raises(KeyError):
        with starting(server):
            threading.Timer(0.05, go.set).start()
            raise KeyError("the stock replay failed")
    assert server.events == ["start", "healthy", "stop"]

