"""Where copies run: the one module that knows about CUDA streams, events and the CPU worker.

GPU: copies are enqueued on a side stream that first waits for the current (compute) stream, and
an event recorded after each layer tells consumers when it landed. CPU: copies run on one worker
thread per lane; torch's copy ops release the GIL, so the forward thread keeps computing.
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
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


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
    """A side stream on `device`. `submit` enqueues `fn` on it from the caller's thread (the
    host returns once the copies are enqueued) and returns a done Future holding fn's result."""

    kind = "cuda-stream"

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def submit(self, fn, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(e)
        return fut

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.synchronize()


def make_lane(device, cpu_threads: int = 1) -> CpuLane | CudaLane:
    device = torch.device(device)
    return CudaLane(device) if device.type == "cuda" else CpuLane(threads=cpu_threads)
