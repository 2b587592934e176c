"""Where copies run: the one module that knows about streams, events and the CPU worker.

Two kinds of lane:
- `DeviceLane`: a side stream on an asynchronous device, a GPU (`torch.cuda`) or the emulated
  device (`emulated.EmulatedDevice`: the same semantics on CPU, so CI runs this branch). A copy
  job runs on the caller's thread with the side stream current and *launches* its copies
  (`lane.launch`): they complete later, in order, on the stream. An event recorded after each
  layer tells consumers when it landed; a consumer makes its own stream wait on exactly that
  event, device side, when it reaches the layer. The host never waits for a copy it enqueued.
- `CpuLane`: one worker thread; a job's copies run there at once (`launch` calls them), and a
  layer is signalled on the host once it is in place.

Ordering against the forward (docs/streaming.md "Ordering"): at submit the side stream waits for
the caller's current stream and for every *forward stream* registered for its device
(`follow_forward_stream`). SGLang 0.5.23 runs the model on `model_runner.forward_stream`, apart
from the scheduler's own `schedule_stream` when overlap scheduling is on, and fences HiCache's
copies on that stream (`Scheduler.__init__` sets the cache controller's
`load_fence_stream` / `write_fence_stream`): a store then reads rows only after the forward that
wrote them, and a load writes slots only after the forward that last read them.

The functions below dispatch on what they are given (a `torch.cuda` stream or event, an emulated
one, or None: a CPU lane, nothing to order).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib

import torch

from .emulated import EmulatedDevice, EmulatedEvent, EmulatedStream

_forward_streams: dict = {}  # device key -> the stream the model's forward runs on


def _key(device) -> object:
    return device if isinstance(device, EmulatedDevice) else str(torch.device(device))


def follow_forward_stream(device, stream) -> None:
    """Order every lane copy on `device` issued from now on after the work `stream` (the
    model's forward stream) has enqueued at that point; None forgets it."""
    if stream is None:
        _forward_streams.pop(_key(device), None)
    else:
        _forward_streams[_key(device)] = stream


def forward_stream(device):
    """The forward stream registered for `device`, or None."""
    return _forward_streams.get(_key(device))


def record_event(stream):
    """Record an event on `stream` (an emulated or CUDA stream; None: the current CUDA stream)
    and return it."""
    if isinstance(stream, EmulatedStream):
        return stream.record_event()
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def wait_event_on_current_stream(event) -> None:
    """Order everything the current stream does from now on after `event`, device side; None
    (a CPU marker: the work is done) is a no-op."""
    if event is None:
        return
    if isinstance(event, EmulatedEvent):
        event.device.current_stream().wait_event(event)
    else:
        torch.cuda.current_stream().wait_event(event)


def wait_events(stream, events) -> None:
    """Make `stream` (the current stream of each event's device when None) wait for each of
    `events`, device side."""
    for event in events:
        if stream is None:
            wait_event_on_current_stream(event)
        else:
            stream.wait_event(event)


def current_stream(device):
    """The calling thread's current stream on `device` (None on a CPU device)."""
    if isinstance(device, EmulatedDevice):
        return device.current_stream()
    device = torch.device(device)
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def done_marker(lane):
    """A marker of everything `lane` has enqueued so far: an event on a device lane, None on a
    CPU lane (whose jobs are done when their futures are)."""
    return record_event(lane.stream) if getattr(lane, "stream", None) is not None else None


def marker_done(marker) -> bool:
    """Whether the work before `done_marker` finished (never blocks)."""
    return marker is None or marker.query()


def wait_marker(marker) -> None:
    """Block the host until the work before `done_marker` finished (a CPU marker: done)."""
    if marker is not None:
        marker.synchronize()


class CpuLane:
    """One worker thread; jobs run in submission order, their copies at once (`launch`).

    The worker's torch ops use `threads` OpenMP threads (a per-thread setting: the forward
    thread keeps its own). One is the default: the lane copies while the forward computes and
    a team of two per index op stalls on its barriers whenever the forward holds the cores
    (measured 10x slower under load), while one thread streams at close to copy speed.
    """

    kind = "cpu-thread"
    stream = None

    def __init__(self, name: str = "swift-copy", threads: int = 1):
        self.threads = threads
        self._pool = cf.ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=name,
            initializer=torch.set_num_threads,
            initargs=(threads,),
        )

    def submit(self, fn, *args) -> cf.Future:
        return self._pool.submit(fn, *args)

    @staticmethod
    def launch(fn) -> None:
        fn()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class DeviceLane:
    """A side stream on `device` (a CUDA device or an `EmulatedDevice`), and on a GPU one on
    `peer`, the other side of a cross-device copy, when that is another GPU. `submit` runs `fn`
    on the caller's thread with the side stream(s) current, so its copies are enqueued and the
    host returns at once; it returns a done Future holding fn's result. Inside `fn`, copies go
    through `launch` (a GPU launches kernels on the current stream by itself; the emulated
    device queues them).

    Ordering: at submit the side stream waits for `device`'s current stream and its registered
    forward stream (module docstring), and the peer stream waits for the side stream. A
    cross-device `copy_` inside `fn` runs on the source device's current stream with a two-way
    barrier to the destination's (PyTorch's rule), so the chain side stream -> copy -> peer
    stream (or back) needs no further events. `stream` (the side stream on `device`) is where a
    layer counter records its events."""

    kind = "device-stream"

    def __init__(self, device, peer=None):
        if isinstance(device, EmulatedDevice):
            self.device, self._api = device, device
            self.stream = device.Stream("lane")
            self.peer_stream = None
            return
        self.device, self._api = torch.device(device), None
        self.stream = torch.cuda.Stream(device=self.device)
        peer = torch.device(peer) if peer is not None else None
        self.peer_stream = (torch.cuda.Stream(device=peer)
                            if peer is not None and peer.type == "cuda" and peer != self.device
                            else None)

    def submit(self, fn, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        self.stream.wait_stream(current_stream(self.device))
        forward = forward_stream(self.device)
        if forward is not None:
            self.stream.wait_stream(forward)
        if self.peer_stream is not None:
            self.peer_stream.wait_stream(self.stream)
        try:
            with self._current():
                fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(e)
        return fut

    def launch(self, fn) -> None:
        """Issue `fn`'s device work on the current stream (inside `submit`: the side stream)."""
        if self._api is None:
            fn()  # a GPU: the kernels fn launches go to the current stream
        else:
            self._api.launch(fn)

    def synchronize(self) -> None:
        self.stream.synchronize()
        if self.peer_stream is not None:
            self.peer_stream.synchronize()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.synchronize()

    def _current(self):
        if self._api is not None:
            return self._api.stream(self.stream)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.stream(self.stream))
        stack.enter_context(torch.cuda.stream(self.peer_stream))
        stack.enter_context(torch.cuda.device(self.device))
        return stack


CudaLane = DeviceLane  # the name the GPU scripts know it by


def make_lane(device, cpu_threads: int = 1, peer=None) -> CpuLane | DeviceLane:
    """The copy lane for local memory on `device` (a torch device, or an `EmulatedDevice`);
    `peer` is the other side's device when it is another GPU (a donor pool on cuda:1 for a
    borrower on cuda:0)."""
    if isinstance(device, EmulatedDevice):
        return DeviceLane(device)
    device = torch.device(device)
    return DeviceLane(device, peer) if device.type == "cuda" else CpuLane(threads=cpu_threads)
