"""LocalServer starts again on a fresh port when the port it chose was taken before the server
bound it (servers started side by side race for ports), and only then."""

from __future__ import annotations

import pytest

from benchmarks.tools import local_server
from benchmarks.tools.local_server import LocalServer, ServerStartError


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
