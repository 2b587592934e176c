"""Where a streamed pool's KV lives: every layer's K and V rows, outside the local pool.

`HostLayerStore` keeps them in host memory (pinned when the pool is on a GPU, so copies are
DMA and asynchronous), one `(2, rows, heads, head_dim)` block per layer with the pool's slot
numbering, so slot s of layer l is `data[l, :, s]` here and row s of the staging buffer there.
It moves rows between itself and a staging buffer of the same shape:

- `load(layer, slots, stage)`: stage[:, s] = data[layer, :, s] for s in slots;
- `save(layer, slots, stage)`: data[layer, :, s] = stage[:, s] for s in slots.

Both are enqueued on a `CopyLane`: on a GPU a side stream that first waits for the compute
stream (so a staging buffer is never refilled while attention still reads it) and whose event
the compute stream waits on before reading what was loaded; on CPU the data plane's copy worker
(`dataplane.streams.CpuLane`), whose future the forward thread waits on. Either way the copies
of layer l+1 run while layer l computes, in the order they were issued. The store never decides
what to copy or when; `pool.py` does.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import torch

from ..dataplane.streams import CpuLane


class CopyLane:
    """Orders copies after the compute stream's past work and before its future reads.

    `run(fn)` enqueues `fn` (which issues copies) and returns a marker; `wait(marker)` makes the
    compute side wait for it; `drain()` blocks the host until everything enqueued has run. On a
    GPU `fn` enqueues on a side stream and the marker is an event the compute stream waits on,
    device side. On CPU `fn` runs on one worker thread (`CpuLane`), in order, while the forward
    thread computes: the marker is its future, and the forward thread is the compute stream,
    so whatever it issued before `run` has already happened. A copy that raised raises at its
    `wait` or at the next `drain`: a forward never reads rows a failed copy left behind."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._worker = None if self.cuda else CpuLane(name="swift-stream-copy")
        self._last: cf.Future | None = None  # CPU: the newest job; jobs run in order
        self._failed: BaseException | None = None  # CPU: the first copy that raised
        self.busy_s = 0.0  # thread CPU time spent issuing (on CPU: doing) copies

    def run(self, fn) -> object:
        if not self.cuda:
            self._last = self._worker.submit(self._timed, fn)
            return self._last
        t0 = time.thread_time()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()
            marker = torch.cuda.Event()
            marker.record(self.stream)
        self.busy_s += time.thread_time() - t0
        return marker

    def _timed(self, fn) -> None:
        t0 = time.thread_time()
        try:
            fn()
        except BaseException as exc:
            self._failed = self._failed or exc
            raise
        finally:
            self.busy_s += time.thread_time() - t0  # only the worker adds on CPU

    def wait(self, marker: object) -> None:
        if isinstance(marker, cf.Future):
            marker.exception()  # waits; a failure of this or an earlier copy raises below
            self._raise_failed()
        elif marker is not None:
            torch.cuda.current_stream().wait_event(marker)

    def drain(self) -> None:
        """Block the host until every enqueued copy finished (before host code reads the store)."""
        if self.cuda:
            self.stream.synchronize()
        elif self._last is not None:
            self._last.exception()  # jobs run in order: the newest done means all are
            self._raise_failed()

    def _raise_failed(self) -> None:
        """A write-through nobody waits for may have failed: the store then lacks rows, so every
        later wait says so instead of letting a forward read them."""
        if self._failed is not None:
            raise RuntimeError("SwiftCache layer streaming: a copy of KV rows failed; the "
                               "store no longer holds every row") from self._failed

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()


class HostLayerStore:
    """Every layer's KV rows of a streamed pool, in host memory."""

    tier = "host"
    where = "host memory"

    def __init__(self, num_layers: int, rows: int, row_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        self.device = device
        self.data = torch.zeros((num_layers, 2, rows, *row_shape), dtype=dtype, pin_memory=pin)
        self.rows_loaded = 0
        self.rows_saved = 0

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    # ---- copies (called inside CopyLane.run) --------------------------------------------------
    def load(self, layer: int, slots, stage: torch.Tensor) -> None:
        """Copy `layer`'s rows at `slots` (a SlotSet) into `stage` (2, rows, ...)."""
        src = self.data[layer]
        self.rows_loaded += slots.count
        if slots.runs is not None:
            for a, b in slots.runs:
                for half in (0, 1):  # each half-run is contiguous on both sides: one DMA
                    stage[half, a:b].copy_(src[half, a:b], non_blocking=True)
            return
        index = slots.index
        on_device = index.to(stage.device, non_blocking=True)
        for half in (0, 1):
            rows = torch.index_select(src[half], 0, index)  # a host gather
            if stage.is_cuda:
                rows = rows.pin_memory().to(stage.device, non_blocking=True)
            stage[half].index_copy_(0, on_device, rows)

    def save(self, layer: int, slots, stage: torch.Tensor) -> None:
        """Copy `stage`'s rows at `slots` into `layer`'s rows (write-through)."""
        dst = self.data[layer]
        self.rows_saved += slots.count
        if slots.runs is not None:
            for a, b in slots.runs:
                for half in (0, 1):
                    dst[half, a:b].copy_(stage[half, a:b], non_blocking=True)
            return
        index = slots.index
        on_device = index.to(stage.device, non_blocking=True)
        for half in (0, 1):
            rows = stage[half].index_select(0, on_device)
            if rows.is_cuda:
                rows = rows.cpu()  # synchronous: a host scatter needs the rows on the host
            dst[half].index_copy_(0, index, rows)

    # ---- whole-slot operations SGLang asks the pool for (host side, after a drain) -------------
    def read_rows(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = index.to("cpu", torch.int64)
        return self.data[layer, 0, index].clone(), self.data[layer, 1, index].clone()

    def write_rows(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        index = index.to("cpu", torch.int64)
        self.data[layer, 0, index] = k.to("cpu", self.data.dtype)
        self.data[layer, 1, index] = v.to("cpu", self.data.dtype)

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """data[:, :, dst] = data[:, :, src] for every layer (SGLang's move_kv_cache)."""
        dst = dst.to("cpu", torch.int64)
        src = src.to("cpu", torch.int64)
        self.data[:, :, dst] = self.data[:, :, src].clone()
