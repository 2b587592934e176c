"""Process liveness on this host, shared by the control channel and the data plane.

A pid names a process only on one host and in one pid namespace, and only until the process
exits and the number is reused. So a peer's pid is evidence of anything only when the peer is
in our namespace (``host_identity()`` equal), and ``process_start_time`` tells a reused pid from
the process that announced it.
"""

from __future__ import annotations

import functools
import hashlib
import os


def process_alive(pid: int, start_time: int = 0) -> bool:
    """True while process `pid` exists and is not a zombie (same host and pid namespace only).
    With `start_time` (from `process_start_time`), a different process that reuses the pid
    counts as dead."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc to ask: existence is all we know
    if stat[0] in (b"Z", b"X"):
        return False
    return not start_time or _start_ticks(stat) in (None, start_time)


def process_start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or 0
    when unknown. Together with the pid it names one process for the host's uptime."""
    stat = _proc_stat(pid)
    ticks = _start_ticks(stat) if stat is not None else None
    return ticks or 0


@functools.cache
def host_identity() -> str:
    """Names this kernel boot and pid namespace: two processes that see the same value can
    check each other's pids. "" when /proc does not say (then no pid is trusted)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{pidns}"


def host_tag() -> str:
    """A short stable digest of `host_identity()` for names of node-wide resources (shared
    memory, sockets), so a sweep only judges names made in its own pid namespace."""
    ident = host_identity()
    return hashlib.sha1(ident.encode()).hexdigest()[:6] if ident else "nohost"


def _proc_stat(pid: int) -> list[bytes] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_ticks(fields: list[bytes]) -> int | None:
    try:
        return int(fields[19])  # field 22 of the whole line; the state is field 3
    except (IndexError, ValueError):
        return None
