"""Where a streamed pool's KV lives: every layer's K and V rows, outside the local pool.

`HostLayerStore` keeps them in host memory (pinned when the pool is on a GPU, so copies are
DMA and asynchronous), one `(2, rows, heads, head_dim)` block per layer with the pool's slot
numbering, so slot s of layer l is `data[l, :, s]` here and row s of the staging buffer there.
It moves rows between itself and a staging buffer of the same shape:

- `load(layer, slots, stage)`: stage[:, s] = data[layer, :, s] for s in slots;
- `save(layer, slots, stage)`: data[layer, :, s] = stage[:, s] for s in slots.

Both are enqueued on a `CopyLane`: on a GPU a side stream that first waits for the compute
stream (so a staging buffer is never refilled while attention still reads it) and whose event
the compute stream waits on before reading what was loaded (on the emulated device the same,
later, on its stream thread); on CPU they run at once, in order. The store never decides what
to copy or when; `pool.py` does.
"""

from __future__ import annotations

import time

import torch

from ..dataplane.emulated import EmulatedDevice


class CopyLane:
    """Orders copies after the compute stream's past work and before its future reads.

    `run(fn)` enqueues `fn` (which issues copies) and returns a marker; `wait(marker)` makes the
    compute side wait for it; `drain()` blocks the host until everything enqueued has run.
    - A GPU: `fn` enqueues on a side stream that first waits for the compute stream; the marker
      is an event the compute stream waits on, device side.
    - The emulated device (`dataplane.emulated.EmulatedDevice`, what CI runs the GPU protocol
      on): `fn` runs later, in order, on the device's stream thread; the marker is an event the
      forward thread (the compute stream of a CPU forward) waits on. A copy that raised fails
      the next wait or drain with the reason, never a later read.
    - A CPU: `fn` runs at once, in the forward thread (marker None). A copy worker was measured
      slower here: the forward thread's CPU time per decode step did not fall while the worker
      copied, and the step waited for the worker (docs/layer_stream.md)."""

    def __init__(self, device):
        self.emulated = device if isinstance(device, EmulatedDevice) else None
        self.cuda = self.emulated is None and torch.device(device).type == "cuda"
        if self.emulated is not None:
            self.stream = self.emulated.Stream("layer-stream-copy")
        else:
            self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.busy_s = 0.0  # thread CPU time spent issuing (CPU, emulated: doing) copies

    def run(self, fn) -> object:
        if self.emulated is not None:
            self.stream.launch(lambda: self._timed(fn))
            return self.emulated.Event().record(self.stream)
        if not self.cuda:
            self._timed(fn)
            return None
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
        finally:
            self.busy_s += time.thread_time() - t0

    def wait(self, marker: object) -> None:
        if marker is None:
            return
        if self.emulated is not None:
            marker.synchronize()  # the CPU forward is its own compute stream
            self._raise_failed()
        else:
            torch.cuda.current_stream().wait_event(marker)

    def drain(self) -> None:
        """Block the host until every enqueued copy finished (before host code reads the store)."""
        if self.stream is not None:
            self.stream.synchronize()
        if self.emulated is not None:
            self._raise_failed()

    def close(self) -> None:
        if self.stream is not None:
            self.drain()

    def _raise_failed(self) -> None:
        """A write-through nobody waits for may have failed: the store then lacks rows, so every
        later wait says so instead of letting a forward read them."""
        if self.emulated.errors:
            raise RuntimeError("SwiftCache layer streaming: a copy of KV rows failed; the "
                               "store no longer holds every row") from self.emulated.errors[0]


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
