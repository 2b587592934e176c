"""Node-wide resources a SwiftCache server creates, kept private to its user and swept when
their creator is gone.

What a server leaves on the node: POSIX shared memory (the donor's arena, a lending server's KV
pool) under /dev/shm, an ipc socket and a rendezvous record in the rendezvous directory. Rules:

* **Private.** Directories are 0700 and every directory above them is ours or root's and not
  writable by others (or sticky, like /tmp), so no other user can swap them. Files, sockets and
  shared memory are 0600.
* **Named by owner.** A shared-memory name carries the creator's uid, a tag of its host and pid
  namespace (``host_tag``) and its pid (``shm_name``); a socket name carries the tag and the pid
  (``socket_name``). Two users never pick the same name, and anyone can tell whose it is.
* **Swept.** A server that exits cleanly removes its own. One that is killed cannot, so every
  agent sweeps at start, and again when it finds a peer's process gone: names of our uid and
  namespace whose pid is dead are unlinked (``sweep_shm``, ``sweep_sockets``). A pid that was
  reused keeps its names until that process exits too: a sweep errs towards keeping.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat

from .process import host_tag, process_alive

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9]*_u(\d+)_h([0-9a-z]+)_p(\d+)_[0-9a-f]{12}$")
_SOCKET_NAME = re.compile(r"^[0-9a-f]+\.h([0-9a-z]+)\.p(\d+)\.sock$")


class PrivatePathError(ValueError):
    """A path that other users could read or replace; the message says how to fix it."""


# ---- names -------------------------------------------------------------------------------
def shm_name(prefix: str) -> str:
    """A fresh shared-memory name owned by this process: ``<prefix>_u<uid>_h<tag>_p<pid>_<12
    hex>``. `prefix` is letters and digits (it says what the memory holds)."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", prefix):
        raise ValueError(f"shared-memory prefix {prefix!r}: use letters and digits only")
    return f"{prefix}_u{os.getuid()}_h{host_tag()}_p{os.getpid()}_{secrets.token_hex(6)}"


def socket_name(stem: str) -> str:
    """This process's ipc socket file name for `stem` (hex): ``<stem>.h<tag>.p<pid>.sock``."""
    return f"{stem}.h{host_tag()}.p{os.getpid()}.sock"


def shm_owner_pid(name: str) -> int | None:
    """The creator's pid of a shared-memory name made by `shm_name` for our uid on our host
    and namespace; None for any other name."""
    m = _SHM_NAME.match(name)
    if m is None or int(m.group(1)) != os.getuid() or m.group(2) != host_tag():
        return None
    return int(m.group(3))


def socket_owner_pid(name: str) -> int | None:
    m = _SOCKET_NAME.match(name)
    if m is None or m.group(1) != host_tag():
        return None
    return int(m.group(2))


# ---- permissions ---------------------------------------------------------------------------
def ensure_private_dir(path: str) -> None:
    """Create `path` 0700 if missing (parents too); refuse it unless it is ours and 0700 and
    no directory above it can be replaced by another user."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PrivatePathError(
            f"directory {path} is mode {stat.S_IMODE(st.st_mode):o} owned by uid {st.st_uid}; "
            f"it must be yours and 0700: `chmod 700 {path}` or choose another directory"
        )
    _check_ancestors(os.path.dirname(os.path.abspath(path)))


def _check_ancestors(path: str) -> None:
    """Every directory from `path` up to / is ours or root's, and writable by others only if
    sticky (then others cannot rename what is ours in it)."""
    while True:
        st = os.stat(path)
        if st.st_uid not in (0, os.getuid()):
            raise PrivatePathError(
                f"{path} belongs to uid {st.st_uid}, who could replace what SwiftCache keeps "
                "below it; choose a directory under one of yours (e.g. --rendezvous-dir)"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise PrivatePathError(
                f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}) without the "
                f"sticky bit; `chmod go-w {path}` or choose another directory"
            )
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


# ---- sweeping ------------------------------------------------------------------------------
def sweep_shm(pid: int | None = None, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink shared memory made by `shm_name` (our uid, host and namespace) whose creator is
    dead (only `pid`'s, when given). Returns the names removed. Mappings other processes still
    hold stay valid; only the name goes."""
    return _sweep(shm_dir, shm_owner_pid, pid, stat.S_ISREG)


def sweep_sockets(directory: str, pid: int | None = None) -> list[str]:
    """Unlink ipc socket files made by `socket_name` in `directory` whose process is dead."""
    return _sweep(directory, socket_owner_pid, pid, stat.S_ISSOCK)


def _sweep(directory: str, owner_of, only_pid: int | None, kind) -> list[str]:
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:  # no such directory (no /dev/shm on this OS): nothing of ours there
        return removed
    for entry in entries:
        pid = owner_of(entry.name)
        if pid is None or (only_pid is not None and pid != only_pid) or process_alive(pid):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != os.getuid() or not kind(st.st_mode):
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue  # someone else swept it first
        except OSError as exc:
            log.warning("cannot remove %s left by dead pid %d: %s", entry.path, pid, exc)
            continue
        removed.append(entry.name)
    if removed:
        log.info("removed %d name(s) left by dead processes in %s: %s", len(removed), directory,
                 removed[:8])
    return removed
