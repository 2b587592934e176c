"""Where copies run: the one module that knows about CUDA streams, events and the CPU worker.

GPU: copies are enqueued on a side stream that first waits for the current (compute) stream, and
an event recorded after each layer tells consumers when it landed. CPU: copies run on one worker
thread per lane; torch's copy ops release the GIL, so the forward thread keeps computing. A copy
that must be finished when its caller goes on (a demotion store whose slots are freed at once)
runs on the caller's thread on CPU (`PoolTransferEngine.store_here`); on a GPU it is enqueued and
the compute stream waits for it (`wait_event_on_current_stream` on its marker), so the host never
waits.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib

import torch


def record_event(stream):
    """Record a CUDA event on `stream` (or the current stream) and return it."""
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def wait_event_on_current_stream(event) -> None:
    """Order everything the current (compute) stream does from now on after `event`,
    GPU-side; None (a CPU marker: the work is done) is a no-op."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


def wait_events(stream, events) -> None:
    """Make `stream` (the current stream when None) wait for each of `events` (GPU-side)."""
    target = stream if stream is not None else torch.cuda.current_stream()
    for event in events:
        target.wait_event(event)


def done_marker(lane):
    """A marker of everything `lane` has enqueued so far: an event on a CUDA lane, None on a
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
    """One worker thread; jobs run in submission order.

    The worker's torch ops use `threads` OpenMP threads (a per-thread setting: the forward
    thread keeps its own). One is the default: the lane copies while the forward computes, and
    on a busy 2-core machine a 2-thread OpenMP team per index op stalls on every barrier
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

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class CudaLane:
    """A side stream on `device` (and one on `peer`, the other side of a cross-device copy,
    when that is another GPU). `submit` enqueues `fn` with both as the current streams of their
    devices, from the caller's thread (the host returns once the copies are enqueued), and
    returns a done Future holding fn's result.

    Ordering: at submit the side stream waits for `device`'s current stream (the caller's own
    forward: a store reads KV it just wrote, a load writes slots it may just have freed), and the
    peer stream waits for the side stream. A cross-device `copy_` inside `fn` runs on the source
    device's current stream with a two-way barrier to the destination's (PyTorch's rule), so the
    chain side stream -> copy -> peer stream (or back) needs no further events. `stream` (the
    side stream on `device`) is where a layer counter records its events."""

    kind = "cuda-stream"

    def __init__(self, device, peer=None):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        peer = torch.device(peer) if peer is not None else None
        self.peer_stream = (torch.cuda.Stream(device=peer)
                            if peer is not None and peer.type == "cuda" and peer != self.device
                            else None)

    def submit(self, fn, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.peer_stream is not None:
            self.peer_stream.wait_stream(self.stream)
        try:
            with torch.cuda.stream(self.stream), torch.cuda.stream(self.peer_stream), \
                    torch.cuda.device(self.device):
                fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(e)
        return fut

    def synchronize(self) -> None:
        self.stream.synchronize()
        if self.peer_stream is not None:
            self.peer_stream.synchronize()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.synchronize()


def make_lane(device, cpu_threads: int = 1, peer=None) -> CpuLane | CudaLane:
    """The copy lane for local memory on `device`; `peer` is the other side's device when it is
    another GPU (a donor pool on cuda:1 for a borrower on cuda:0)."""
    device = torch.device(device)
    return CudaLane(device, peer) if device.type == "cuda" else CpuLane(threads=cpu_threads)
