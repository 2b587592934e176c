"""The CPU copies and streams behind the HiCache stand-ins (see `hicache`): plain torch, no SGLang.

Host KV layouts, one component (K or V) of SGLang's MHA host buffer, token slot t, page size P:
  layer_first        (layer, t, head, dim)
  page_first         (t, layer, head, dim)
  page_first_direct  (t // P, layer, t % P, head, dim)
  page_head          (t // P, head, t % P, layer, dim)
A device layer is (slot, head, dim). Every copy is an index_select / index_copy_ (or an advanced
index for the paged layouts) on the calling thread; it has completed when the call returns, which
is why the stream and event objects here never wait.
"""

from __future__ import annotations

import time

import torch


# -- the copies ---------------------------------------------------------------------------------
def _host_rows(buffer, layout: str, layer: int, idx, page_size: int):
    """(view, index): view[index] are the rows (n, heads, dim) of host token slots `idx` in
    `layer`, for one component (K or V) of the host buffer in `layout`."""
    if layout == "layer_first":  # (layer, token, head, dim)
        return buffer[layer], (idx,)
    if layout == "page_first":  # (token, layer, head, dim)
        return buffer[:, layer], (idx,)
    if layout == "page_first_direct":  # (page, layer, token in page, head, dim)
        return buffer[:, layer], (idx // page_size, idx % page_size)
    if layout == "page_head":  # (page, head, token in page, layer, dim)
        return buffer[:, :, :, layer], (idx // page_size, slice(None), idx % page_size)
    raise ValueError(f"no CPU copy for the HiCache host layout {layout!r}")


def gather_host(buffer, layout: str, layer: int, idx, page_size: int):
    """The rows (n, heads, dim) of host slots `idx` of `layer` (a copy)."""
    view, index = _host_rows(buffer, layout, layer, _long(idx), page_size)
    return view.index_select(0, index[0]) if len(index) == 1 else view[index]


def scatter_host(buffer, layout: str, layer: int, idx, rows, page_size: int) -> None:
    """Write `rows` (n, heads, dim) into host slots `idx` of `layer`, in place."""
    view, index = _host_rows(buffer, layout, layer, _long(idx), page_size)
    if len(index) == 1:
        view.index_copy_(0, index[0], rows)
    else:
        view[index] = rows


def load_layer(host, device, layout, layer, host_idx, device_idx, page_size) -> None:
    """Host -> device for one component of one layer: device[device_idx] = host rows."""
    device.index_copy_(0, _long(device_idx),
                       gather_host(host, layout, layer, host_idx, page_size))


def backup_layer(host, device, layout, layer, host_idx, device_idx, page_size) -> None:
    """Device -> host for one component of one layer: host rows = device[device_idx]."""
    rows = device.index_select(0, _long(device_idx))
    scatter_host(host, layout, layer, host_idx, rows, page_size)


def _long(idx):
    """Indices as CPU int64 (SGLang hands int64; a CPU pool may get them from any device)."""
    if idx.dtype == torch.int64 and idx.device.type == "cpu":
        return idx
    return idx.to("cpu", torch.int64)


# -- streams and events ---------------------------------------------------------------------
class CpuEvent:
    """An event of work that ran synchronously on the host: complete once recorded (and before:
    nothing is pending). Timing, when asked for, is wall-clock between two records."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t = None

    def record(self, stream=None) -> None:
        self._t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def elapsed_time(self, end: "CpuEvent") -> float:
        if not (self.enable_timing and self._t is not None and end._t is not None):
            raise RuntimeError("elapsed_time needs two recorded events created with "
                               "enable_timing=True")
        return (end._t - self._t) * 1000.0


class CpuStream:
    """A stream whose work has always completed: every wait and synchronize returns at once."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> CpuEvent:
        event = event or CpuEvent()
        event.record(self)
        return event


class _StreamContext:
    def __init__(self, stream) -> None:
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc) -> None:
        return None


class CpuDeviceModule:
    """What SGLang's HiCache modules use of `device_module` (torch.cuda on a GPU)."""

    __name__ = "sglang_swift.cpu_compat.hicache_ops.CpuDeviceModule"
    __swiftcache_stand_in__ = "cpu_device_module"  # hicache.MARK: installing twice is a no-op
    Stream = CpuStream
    Event = CpuEvent
    _current = CpuStream()

    @staticmethod
    def current_stream(device=None) -> CpuStream:
        return CpuDeviceModule._current

    @staticmethod
    def stream(stream) -> _StreamContext:
        return _StreamContext(stream)


    @staticmethod
    def synchronize(device=None) -> None:
        return None
