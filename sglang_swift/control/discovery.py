"""Discovery without a central process: each agent publishes one record file in a shared 0700
directory and scans it; a configured list of endpoints can be used as well (or instead).

A record is small JSON (``agent_id``, ``epoch``, ``pid``, ``endpoint``, ``model``), written
atomically (temp file + rename), mode 0600, removed on clean shutdown. Records of dead
processes are skipped by the scanner; ``sweep`` removes them with the sockets of dead agents
(an agent sweeps when it starts and when it finds a peer's process gone; `ctl sweep` too).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

from sglang_swift.common.private_resources import socket_name, sweep_sockets
from sglang_swift.common.process import host_identity, process_alive
from sglang_swift.control.control_config import ControlConfigError

_SUFFIX = ".peer"
_IPC_PATH_MAX = 107  # sun_path limit on Linux


@dataclass(frozen=True)
class PeerRecord:
    agent_id: str
    epoch: int
    pid: int
    endpoint: str
    model: str = ""
    host: str = ""  # common.process.host_identity() of the publisher: its pid means this


pid_alive = process_alive


def ipc_endpoint(rendezvous_dir: str, agent_id: str) -> str:
    """A short socket path per agent id and process (the id hashed, so long ids fit the
    107-byte ipc limit; the pid, so a sweep can tell a dead agent's socket)."""
    digest = hashlib.sha1(agent_id.encode()).hexdigest()[:16]
    path = os.path.join(rendezvous_dir, socket_name(digest))
    if len(path.encode()) > _IPC_PATH_MAX:
        raise ControlConfigError(
            f"ipc path {path} exceeds {_IPC_PATH_MAX} bytes; use a shorter "
            "rendezvous_dir (or transport='tcp')"
        )
    return f"ipc://{path}"


def _record_path(rendezvous_dir: str, agent_id: str) -> str:
    return os.path.join(rendezvous_dir, agent_id + _SUFFIX)


def read_records(
    rendezvous_dir: str, cache: dict[str, tuple[int, PeerRecord | None]] | None = None
) -> list[PeerRecord]:
    """All parseable records in the directory; unreadable or malformed ones are skipped.
    With ``cache`` (path -> (mtime, record)), unchanged files are not read again."""
    out: list[PeerRecord] = []
    try:
        entries = [e for e in os.scandir(rendezvous_dir) if e.name.endswith(_SUFFIX)]
    except FileNotFoundError:
        return out
    if cache is not None:
        for gone in cache.keys() - {e.path for e in entries}:
            del cache[gone]
    for entry in entries:
        try:
            mtime = entry.stat().st_mtime_ns
            hit = cache.get(entry.path) if cache is not None else None
            rec = hit[1] if hit is not None and hit[0] == mtime else _parse(entry.path)
        except OSError:
            continue
        if cache is not None:
            cache[entry.path] = (mtime, rec)
        if rec is not None:
            out.append(rec)
    return out


def _parse(path: str) -> PeerRecord | None:
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read(8192))
        return PeerRecord(
            str(raw["agent_id"]),
            int(raw["epoch"]),
            int(raw["pid"]),
            str(raw["endpoint"]),
            str(raw.get("model", "")),
            str(raw.get("host", "")),
        )
    except (ValueError, KeyError, TypeError):
        return None


def next_epoch(rendezvous_dir: str, agent_id: str) -> int:
    """A new epoch, larger than any this agent id used before; refuses a live duplicate id."""
    prev = 0
    for rec in read_records(rendezvous_dir):
        if rec.agent_id == agent_id:
            if rec.pid != os.getpid() and pid_alive(rec.pid):
                raise ControlConfigError(
                    f"agent id {agent_id!r} is in use by live pid {rec.pid}; "
                    "give every server its own agent_id"
                )
            prev = rec.epoch
    return max(prev + 1, time.time_ns() // 1000)


def publish(rendezvous_dir: str, rec: PeerRecord) -> None:
    path = _record_path(rendezvous_dir, rec.agent_id)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(rec), f)
    os.replace(tmp, path)


def withdraw(rendezvous_dir: str, rec: PeerRecord) -> None:
    """Remove our record, unless a newer incarnation already replaced it."""
    path = _record_path(rendezvous_dir, rec.agent_id)
    for cur in read_records(rendezvous_dir):
        if cur.agent_id == rec.agent_id and cur.epoch == rec.epoch:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def sweep(rendezvous_dir: str, pid: int | None = None) -> list[str]:
    """Remove the records and ipc sockets that agents on this host (of process `pid`, when
    given) left when they died without withdrawing. Returns the file names removed. A record is
    taken aside by rename first, so one a new incarnation publishes meanwhile is never lost."""
    removed = sweep_sockets(rendezvous_dir, pid)
    here = host_identity()
    for rec in read_records(rendezvous_dir):
        if not here or rec.host != here or pid not in (None, rec.pid) or pid_alive(rec.pid):
            continue
        path = _record_path(rendezvous_dir, rec.agent_id)
        aside = f"{path}.{os.getpid()}.sweep"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        now = _parse(aside)
        if now is not None and (now.pid, now.epoch) != (rec.pid, rec.epoch):
            try:  # a newer incarnation published meanwhile: put it back unless a newer one is
                os.link(aside, path)
            except FileExistsError:
                pass
        else:
            removed.append(os.path.basename(path))
        os.unlink(aside)
    return removed
