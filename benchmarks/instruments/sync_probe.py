"""Host-device synchronisations counted on a CPU-only machine.

On a GPU the scheduler thread must never wait for the device: reading a device tensor's values
(`item`, `tolist`, `int(t)`, `bool(t)`, iteration), copying it to the host without
`non_blocking`, an op whose output size depends on device data (`nonzero`, `unique`, boolean
indexing, `repeat_interleave` without `output_size`), and a blocking host-to-device copy
(torch's `memcpy_and_sync`) all stall it until the GPU catches up. On CPU all of these are free,
so nothing shows them. Here a tensor is *marked* as living on the device (`DeviceTensor`, a
plain CPU tensor of a subclass that every op propagates), and `SyncProbe`, a
`TorchFunctionMode`, counts what would be a synchronisation on a GPU:

- `read`: values of a device tensor read on the host (`item`, `tolist`, `numpy`, `int()`,
  `bool()`, `__index__`, iteration, `torch.equal`, printing);
- `d2h`: a device tensor copied to the host without `non_blocking=True` (`.cpu()`, `.to("cpu")`,
  a host tensor's `copy_` from it);
- `shape`: an op on a device tensor whose output size depends on its values;
- `h2d`: host data reaching a device op without an asynchronous copy: an op mixing a device
  tensor with a host tensor of at least one element (on a GPU an error, or a copy made for it),
  `torch.tensor` / `torch.as_tensor` of host data with an explicit device.

`.to(device, non_blocking=True)` of a host tensor is an asynchronous copy (SGLang's own idiom;
pinned memory makes it fully asynchronous) and marks its result as a device tensor; a factory
given an explicit `device=` (`torch.empty`, `zeros`, `arange`, ...) creates one. Counting is on
only inside `probe.counting()`, and off inside `probe.device_side()` (code that runs on the
device itself on a GPU: a copy kernel whose CPU reference reads indices because the CPU is the
device there). Each count keeps its call site, so a failure names the line.

Host waits on an asynchronous device are not torch functions: with an emulated device attached
(`attach`, dataplane/emulated.py) the probe also counts every `Event.synchronize` and
`Stream.synchronize` a counting thread makes there (kind `wait`). A copy lane on that device runs
its jobs on the scheduler thread, as a GPU lane does, so what the lane's job does on the host is
counted too; what it launches runs on the device's stream threads and is not (device side).
`device_side()` is per thread.

The scenarios it counts are in `tests/unit/test_sync_free.py`; on a GPU, `scripts/gpu_check.py`
runs the scheduler-thread hooks under `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

T = torch.Tensor
READS = {T.item, T.tolist, T.numpy, T.__int__, T.__index__, T.__float__, T.__bool__,
         T.__complex__, T.__array__, T.__iter__, T.__repr__, T.__format__, T.equal, torch.equal,
         T.allclose, torch.allclose}
SHAPE_OPS = {T.nonzero, torch.nonzero, T.unique, torch.unique, T.unique_consecutive,
             torch.unique_consecutive, T.masked_select, torch.masked_select, torch.argwhere,
             T.argwhere, T.bincount, torch.bincount, torch.nonzero_static}
FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.empty_like,
             torch.zeros_like, torch.ones_like, torch.full_like, torch.randperm}
FROM_HOST_DATA = {torch.tensor, torch.as_tensor}
# reads of metadata only: never a synchronisation
METADATA = {T.__len__, T.dim, T.numel, T.size, T.element_size, T.is_contiguous,
            T.stride, T.storage_offset}


class DeviceTensor(torch.Tensor):
    """A CPU tensor standing for one on the GPU: ops on it return DeviceTensors, a copy to
    the host returns a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if _to_host(func, args, kwargs):  # `.to` of a CPU tensor may return it unchanged
            return out.as_subclass(torch.Tensor)
        if func in READS:
            return out
        return torch._tensor._convert(out, cls)


def device(t: torch.Tensor) -> DeviceTensor:
    """`t` marked as a device tensor (shares its storage)."""
    return t.as_subclass(DeviceTensor)


def is_device(t) -> bool:
    return isinstance(t, DeviceTensor)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _target_device(args, kwargs):
    """The device a `Tensor.to` call moves to, or None."""
    if "device" in kwargs and kwargs["device"] is not None:
        return torch.device(kwargs["device"])
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def _to_host(func, args, kwargs) -> bool:
    """Whether `func` copies its device tensor to the host (and so returns a host tensor)."""
    if func is T.cpu:
        return True
    if func is T.to:
        target = _target_device(args, kwargs)
        return target is not None and target.type == "cpu" and not kwargs.get("non_blocking")
    return False


class SyncProbe(TorchFunctionMode):
    """Counts, by kind and call site, the operations that would synchronise a GPU (see the
    module docstring). Use as a context manager around the whole scenario; counting happens
    only inside `counting()`."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()
        self._on = False
        self._local = threading.local()  # per thread: how deep inside device_side()
        self._devices: list = []  # emulated devices whose host waits are counted too

    def attach(self, emulated_device) -> None:
        """Count the host waits (event and stream synchronize) that threads counting here make
        on `emulated_device` (dataplane/emulated.py), as kind `wait`."""
        self._devices.append(emulated_device)

    @contextlib.contextmanager
    def counting(self):
        was, self._on = self._on, True
        with contextlib.ExitStack() as stack:
            found = [stack.enter_context(d.counting_syncs()) for d in self._devices]
            try:
                yield self
            finally:
                self._on = was
        for waits in found:
            for what, site in waits:
                self.counts["wait"] += 1
                self.sites[f"wait {what} at {site}"] += 1

    @contextlib.contextmanager
    def device_side(self):
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts.clear()
        self.sites.clear()

    def report(self, limit: int = 12) -> str:
        return "; ".join(f"{n} x {site}" for site, n in self.sites.most_common(limit))

    def _count(self, kind: str, func) -> None:
        self.counts[kind] += 1
        here = _site()
        self.sites[f"{kind} {getattr(func, '__name__', func)} at {here}"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._on and not getattr(self._local, "depth", 0) and func not in METADATA:
            self._inspect(func, args, kwargs)
        out = func(*args, **kwargs)
        if func is T.to and not any(map(is_device, args[:1])) and kwargs.get("non_blocking") \
                and _target_device(args, kwargs) is not None:
            return device(out)  # an asynchronous host-to-device copy
        if func in FACTORIES and kwargs.get("device") is not None:
            return device(out)
        if func in FROM_HOST_DATA and kwargs.get("device") is not None:
            return device(out)
        return out

    def _inspect(self, func, args, kwargs) -> None:
        tensors = list(_tensors((args, kwargs)))
        on_device = [t for t in tensors if is_device(t)]
        if func in FROM_HOST_DATA and kwargs.get("device") is not None and not on_device:
            self._count("h2d", func)
            return
        if not on_device:
            return
        if func in READS:
            self._count("read", func)
        elif func in SHAPE_OPS:
            self._count("shape", func)
        elif func is torch.repeat_interleave or func is T.repeat_interleave:
            if kwargs.get("output_size") is None:
                self._count("shape", func)
        elif func in (T.__getitem__, T.__setitem__) and _bool_or_list_index(args[1]):
            self._count("shape", func)
        elif func is torch.where and len(args) + len(kwargs) == 1:
            self._count("shape", func)
        elif _to_host(func, args, kwargs):
            self._count("d2h", func)
        elif func is T.copy_ and not is_device(args[0]) and not kwargs.get("non_blocking") \
                and not (len(args) > 2 and args[2]):
            self._count("d2h", func)
        elif func is T.copy_ and is_device(args[0]) and not is_device(args[1]) \
                and not kwargs.get("non_blocking") and not (len(args) > 2 and args[2]):
            self._count("h2d", func)
        elif func not in (T.to, T.copy_) and any(
                not is_device(t) and t.dim() > 0 and t.numel() > 0 for t in tensors):
            self._count("h2d", func)


def _bool_or_list_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool)
               for p in parts)


def _site() -> str:
    """The innermost frame outside torch and this module: where the operation was asked for."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename
        if "/torch/" in name or name.endswith("sync_probe.py"):
            continue
        parts = name.split("/")
        return f"{'/'.join(parts[-2:])}:{frame.lineno}"
    return "?"
