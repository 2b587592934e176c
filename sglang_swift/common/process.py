"""Process liveness on this host, shared by the control channel and the data plane."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie (same host only)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True
