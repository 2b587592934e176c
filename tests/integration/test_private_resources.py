"""What a server leaves on the node is private to its user and cleaned however it exits: a
donor and a borrower in their own processes (real shared memory, ipc sockets, rendezvous
records), each killed with SIGKILL together with its helpers (its process group)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sglang_swift.control import ControlAgent, ControlConfig

pytestmark = pytest.mark.integration

OWNER = Path(__file__).with_name("resource_owner.py")
TIMEOUT = 1.0  # the owners' heartbeat timeout (the default)
SLACK = 2.0  # scheduling noise on a loaded 2-core machine


def _start(role: str, rdv: str, logs: str) -> tuple[subprocess.Popen, dict]:
    with open(os.path.join(logs, f"{role}.log"), "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(OWNER), "--role", role, "--rendezvous-dir", rdv],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,  # its own process group: killpg takes its helpers too
        )
    ready, _, _ = select.select([proc.stdout], [], [], 90)
    line = proc.stdout.readline() if ready else ""
    if not line:
        _kill(proc)
        raise AssertionError(f"{role} never got ready; see {logs}/{role}.log")
    return proc, json.loads(line)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _until_gone(paths: list[str], timeout: float) -> float:
    """Seconds until none of `paths` exists; AssertionError naming the survivors at `timeout`."""
    start = time.monotonic()
    while any(os.path.exists(p) for p in paths):
        assert time.monotonic() - start < timeout, [p for p in paths if os.path.exists(p)]
        time.sleep(0.05)  # polling the file system; there is no event to wait for
    return time.monotonic() - start


def test_resources_are_private_and_swept_after_sigkill():
    """Sockets, records, the secret and shared memory are 0600 in a 0700 directory, named with
    the owner's uid and pid. A SIGKILLed donor's shared memory, socket and record are removed
    by its surviving borrower within the heartbeat timeout; a SIGKILLed borrower's socket and
    record by the next agent that starts. Nothing of theirs is left."""
    root = tempfile.mkdtemp(prefix="swcp")
    rdv = os.path.join(root, "r")
    procs: list[subprocess.Popen] = []
    try:
        donor, d = _start("donor", rdv, root)
        procs.append(donor)
        borrower, b = _start("borrower", rdv, root)
        procs.append(borrower)
        shm = f"/dev/shm/{d['shm']}"
        assert b["mapped"] == d["shm"]
        assert f"_u{os.getuid()}_" in d["shm"] and f"_p{d['pid']}_" in d["shm"]
        sockets = {r: i["endpoint"][len("ipc://") :] for r, i in (("donor", d), ("borrower", b))}
        records = {r: os.path.join(rdv, f"{r}.peer") for r in sockets}
        assert _mode(rdv) == 0o700
        for path in [shm, os.path.join(rdv, "secret"), *sockets.values(), *records.values()]:
            assert _mode(path) == 0o600, path
            assert os.lstat(path).st_uid == os.getuid(), path
        assert all(f".p{i['pid']}." in sockets[r] for r, i in (("donor", d), ("borrower", b)))

        _kill(donor)
        assert os.path.exists(shm), "precondition: a SIGKILL leaves the arena's name behind"
        took = _until_gone([shm, sockets["donor"], records["donor"]], TIMEOUT + SLACK)
        assert took <= TIMEOUT + SLACK

        _kill(borrower)
        left = [sockets["borrower"], records["borrower"]]
        assert all(os.path.exists(p) for p in left), "precondition: nobody was left to sweep"
        agent = ControlAgent(ControlConfig("next", rendezvous_dir=rdv)).start()
        try:
            assert not any(os.path.exists(p) for p in left)
            assert agent.counters.get("swept", 0) >= 2
        finally:
            agent.stop()
        assert sorted(os.listdir(rdv)) == ["secret"]
    finally:
        for proc in procs:
            _kill(proc)
        shutil.rmtree(root, ignore_errors=True)
