"""An emulated asynchronous device: CUDA's stream and event semantics on CPU.

The data plane's GPU branch (copies enqueued on a side stream, an event per layer, the forward's
stream waiting on exactly the event of the layer it reads, markers, lane synchronisation under a
fence) is only right if work really completes *later* than it is issued. On a CPU lane it runs on
a worker thread with host-side signals, which is a different protocol. This module gives the GPU
protocol a device on CPU, so CI runs the branch a GPU takes (STYLE 15):

- `EmulatedStream`: a FIFO of launched work run in order by the stream's own thread, later than
  it was launched. `wait_event(e)` / `wait_stream(s)` order later work after `e` (device side: the
  host does not wait); `synchronize()` blocks the host until the stream ran what it had.
- `EmulatedEvent`: `record(stream)` marks a point of `stream`'s queue; `query()` says whether the
  stream passed it (an event never recorded counts as passed, as CUDA's does);
  `synchronize()` blocks the host until then.
- `EmulatedDevice`: a default stream, the *current stream* of each host thread (`stream(s)`
  sets it for a block, as `torch.cuda.stream` does) and `launch(fn)`: what a kernel launch is,
  `fn` queued on the current stream.

Tensors stay CPU tensors; only *when* launched work runs is emulated. Every host synchronisation
(`Event.synchronize`, `Stream.synchronize`, `EmulatedDevice.synchronize`) is counted with the
thread that made it and its call site (`sync_log`), which is how the CPU checks see a host wait
that a GPU would make. A launched function that raises is logged and kept in `errors` (a CUDA
kernel fault is sticky and asynchronous too); the stream runs on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
import weakref
from collections import deque
from typing import Callable

logger = logging.getLogger(__name__)


class EmulatedEvent:
    """A point in a stream's work (see the module docstring)."""

    def __init__(self, device: "EmulatedDevice | None" = None):
        self.device = device
        self._passed: threading.Event | None = None  # None: never recorded

    def record(self, stream: "EmulatedStream | None" = None) -> "EmulatedEvent":
        if stream is None:
            if self.device is None:
                raise ValueError("an EmulatedEvent without a device needs a stream to record on")
            stream = self.device.current_stream()
        self.device = stream.device
        passed = threading.Event()
        self._passed = passed
        stream._put(("mark", passed))
        return self

    def query(self) -> bool:
        return self._passed is None or self._passed.is_set()

    def synchronize(self) -> None:
        if self._passed is not None and not self._passed.is_set():
            self.device._count_sync("Event.synchronize")
            self._passed.wait()

    def wait(self, stream: "EmulatedStream | None" = None) -> None:
        """Make `stream` (the current one when None) wait for this event, device side."""
        (stream or self.device.current_stream()).wait_event(self)


class EmulatedStream:
    """Launched work run in order by this stream's own thread (see the module docstring)."""

    def __init__(self, device: "EmulatedDevice", name: str = "stream"):
        self.device = device
        self.name = name
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread = threading.Thread(target=self._run, name=f"emulated-{name}", daemon=True)
        self._thread.start()

    # ---- what the host issues (never blocks, except synchronize) ----------------------------
    def launch(self, fn: Callable[[], object]) -> None:
        self._put(("run", fn))

    def wait_event(self, event: EmulatedEvent) -> None:
        if event._passed is not None:
            self._put(("wait", event._passed))

    def wait_stream(self, other: "EmulatedStream") -> None:
        if other is not self:
            self.wait_event(EmulatedEvent(other.device).record(other))

    def record_event(self, event: EmulatedEvent | None = None) -> EmulatedEvent:
        return (event or EmulatedEvent(self.device)).record(self)

    def query(self) -> bool:
        with self._cond:
            return not self._queue and not self._busy

    def synchronize(self) -> None:
        marker = EmulatedEvent(self.device).record(self)
        if not marker.query():
            self.device._count_sync("Stream.synchronize")
            marker._passed.wait()

    # ---- the stream's own thread -------------------------------------------------------------
    def _put(self, item) -> None:
        with self._cond:
            self._queue.append(item)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._busy = False
                    self._cond.wait()
                kind, what = self._queue.popleft()
                self._busy = True
            if kind == "run":
                try:
                    what()
                except Exception as exc:  # noqa: BLE001 - kept, as a device fault would be
                    logger.exception("emulated device: work launched on %s raised", self.name)
                    self.device.errors.append(exc)
            elif kind == "wait":
                what.wait()
            else:  # "mark"
                what.set()


class EmulatedDevice:
    """One emulated device: its default stream and each host thread's current stream."""

    type = "emulated"

    def __init__(self, name: str = "emulated"):
        self.name = name
        self._streams: weakref.WeakSet = weakref.WeakSet()
        self.default_stream = self.Stream(f"{name}-default")
        self._local = threading.local()
        self._log_lock = threading.Lock()
        self.sync_log: list[tuple[str, str, str]] = []  # (thread, what, call site)
        self.errors: list[BaseException] = []

    # the torch.cuda-shaped surface the lanes use -----------------------------------------------
    def Stream(self, name: str = "side") -> EmulatedStream:  # noqa: N802 - torch.cuda's name
        stream = EmulatedStream(self, name)
        self._streams.add(stream)
        return stream

    def Event(self) -> EmulatedEvent:  # noqa: N802 - torch.cuda's name
        return EmulatedEvent(self)

    def current_stream(self) -> EmulatedStream:
        return getattr(self._local, "stream", None) or self.default_stream

    @contextlib.contextmanager
    def stream(self, stream: EmulatedStream | None):
        """Make `stream` this thread's current stream for the block (None: unchanged)."""
        if stream is None:
            yield
            return
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def launch(self, fn: Callable[[], object]) -> None:
        """A kernel launch: `fn` runs later, in order, on the current stream."""
        self.current_stream().launch(fn)

    def synchronize(self) -> None:
        """Block the host until every stream of the device ran what it had (CUDA's
        device synchronize)."""
        self._count_sync("device.synchronize")
        for stream in list(self._streams):
            stream.synchronize()

    # ---- the synchronisation log ---------------------------------------------------------------
    def _count_sync(self, what: str) -> None:
        site = _call_site()
        with self._log_lock:
            self.sync_log.append((threading.current_thread().name, what, site))

    @contextlib.contextmanager
    def counting_syncs(self, thread: threading.Thread | None = None):
        """Yield a list that ends up holding the host synchronisations made inside the block
        (by `thread`, the calling one when None), each as (what, call site)."""
        who = (thread or threading.current_thread()).name
        start = len(self.sync_log)
        found: list[tuple[str, str]] = []
        try:
            yield found
        finally:
            with self._log_lock:
                found.extend((what, site) for name, what, site in self.sync_log[start:]
                             if name == who)


def _call_site() -> str:
    """The first frame outside this module and the stream dispatch (`streams.py`), as
    file:line (function): the code that asked for the wait."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.endswith(("dataplane/emulated.py", "dataplane/streams.py")):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} ({frame.name})"
    return "?"
