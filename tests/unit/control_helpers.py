"""What the in-process control-agent tests share: a donor's memory descriptor, a short rendezvous
directory (ipc socket paths are limited to 107 bytes), and waiting for one agent event."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager

MEM = dict(
    kind="shm",
    handle=b"arena",
    device="cpu",
    total_bytes=256 * 32,
    block_bytes=256,
    num_blocks=32,
    owner_pid=os.getpid(),
    owner_uuid="",
)


@contextmanager
def short_rendezvous(prefix: str):
    """A short rendezvous path, removed afterwards."""
    root = tempfile.mkdtemp(prefix=prefix)
    try:
        yield os.path.join(root, "r")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def next_event(agent, kind, timeout: float = 5.0, **match):
    """The agent's next event of type `kind` whose attributes equal `match` (others skipped)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        e = agent.next_event(left)
        if isinstance(e, kind) and all(getattr(e, k) == v for k, v in match.items()):
            return e
    raise AssertionError(f"no {kind.__name__} {match or ''} within {timeout}s")
