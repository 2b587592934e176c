"""Waking rank 0's scheduler loop when a control event needs the pump (`--tp` > 1).

A TP server handles its agent's events only at the scheduler's pump (`runtime._pump_tp`): a
reclaim is acknowledged by rank 0 once every rank fenced the pages there, and a TP donor's pages
come back into its allocators there. An idle SGLang scheduler started with `--sleep-on-idle`
blocks in `IdleSleeper.maybe_sleep` (a zmq poll of up to a second over the tokenizer and rpc
sockets; only rank 0 has a sleeper, the other ranks wait on rank 0's broadcast), so without a
wake the donor waited for the pages until the next request or the end of that second.

`LoopWake` is a pipe: its read end sits in the sleeper's poller beside SGLang's sockets
(`touchpoints.IDLE_POLLER`), and the agent's I/O thread writes one byte after it queued an event
that needs the pump (`runtime.WAKE_EVENTS`; `ControlAgent.on_queued`), so the poll returns and
the loop runs. The scheduler thread drains the pipe at each step (`drain`, a non-blocking read)
and a drained wake makes that step's pump due: the poll does not return again for a byte already
seen (no busy loop), and the event, queued before its byte, is there for the pump. Bytes only,
no pickle. Without a sleeper (no `--sleep-on-idle`) the loop spins and nothing is registered;
the drain still makes the next loop's pump due.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)


class LoopWake:
    """A non-blocking pipe: `wake` from any thread, `drain` on the scheduler thread."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()  # not inherited by child processes (PEP 446)
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()  # no write to a closed (maybe reused) descriptor
        self._poller: Any = None
        self.wakes = 0  # wakes written (one byte each)

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        """Make the poll return (and the next `drain` true). Never blocks: a full pipe already
        holds a wake not yet drained."""
        with self._lock:
            if self._w < 0:
                return
            try:
                os.write(self._w, b"\x01")
                self.wakes += 1
            except BlockingIOError:
                pass

    def drain(self) -> bool:
        """Read every wake byte there is; True when there was one (the pump is due)."""
        woken = False
        while self._r >= 0:
            try:
                data = os.read(self._r, 4096)
            except BlockingIOError:
                break
            if not data:
                break
            woken = True
        return woken

    def watch(self, scheduler: Any) -> str:
        """Put the read end into `scheduler`'s idle sleeper's zmq poller when it has one; what
        was done, in words (for the log)."""
        sleeper = getattr(scheduler, "idle_sleeper", None)
        if sleeper is None:
            return "no idle sleeper (the loop does not sleep): nothing to register"
        poller = getattr(sleeper, "poller", None)
        if poller is None or not hasattr(poller, "register"):
            return (f"the idle sleeper ({type(sleeper).__name__}) has no zmq poller: an idle "
                    f"loop handles a reclaim when it wakes on its own (within about a second)")
        import zmq

        poller.register(self._r, zmq.POLLIN)
        self._poller = poller
        return "registered on the idle sleeper's poller"

    def close(self) -> None:
        """Leave the poller and close both ends (a later `wake` does nothing)."""
        with self._lock:
            if self._poller is not None:
                try:
                    self._poller.unregister(self._r)
                except KeyError:
                    pass
                self._poller = None
            for fd in (self._r, self._w):
                if fd >= 0:
                    os.close(fd)
            self._r = self._w = -1
