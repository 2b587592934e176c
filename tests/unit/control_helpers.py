"""What the in-process control-agent tests share: a donor's memory descriptor, a short rendezvous
directory (ipc socket paths are limited to 107 bytes), and waiting for one agent event."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager

# a donor pool of 32 one-token pages of 256 bytes (one layer, K and V of 64 float16 each)
MEM = dict(
    kind="shm",
    handle=b"arena",
    device="cpu",
    total_bytes=256 * 32,
    block_bytes=256 * 32,
    num_blocks=1,
    owner_pid=os.getpid(),
    owner_uuid="",
    layout=dict(num_layers=1, rows=32, padded_rows=32, head_num=1, head_dim=64, v_head_dim=64,
                dtype="float16", page_size=1, data_offset=0),
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
