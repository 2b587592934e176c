"""Per-layer KV buffers whose low rows are the layer's own memory and whose high rows are shared.

A streamed pool with resident rows (`--swiftcache-layer-stream-resident-fraction`) gives every
layer one `(2, rows, *row_shape)` buffer, K then V, as SGLang's attention backends index it by
slot, but backs it with two kinds of physical memory:

- rows `[0, resident)`: the layer's own memory (every layer has its own, as in a stock pool), so
  a request whose slots are all below `resident` is never copied anywhere;
- rows `[resident, rows)`: staging buffer `layer % depth`, shared by every depth-th layer and
  filled just in time from the store, as in a pool that streams every row.

One tensor cannot say that with strides, so each layer's buffer is a range of virtual addresses
onto which the pieces are mapped: on CPU `mmap(MAP_FIXED)` of a memfd (`_HostMapper`), on a GPU
CUDA's virtual memory management (`_CudaMapper`: `cuMemAddressReserve`, one `cuMemCreate`
allocation per piece, `cuMemMap`). Both need each piece's size to be a multiple of the mapping
granularity (4 KiB pages; on a GPU usually 2 MiB), so `resident` and `rows` are rounded by
`aligned_rows`. Local memory: `L x resident + depth x (rows - resident)` rows of K and of V.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import weakref

import torch


def row_unit(row_bytes: int, granularity: int) -> int:
    """The fewest rows whose bytes are a multiple of `granularity`."""
    return granularity // math.gcd(granularity, row_bytes)


def aligned_rows(resident: int, rows: int, row_bytes: int, granularity: int,
                 page_size: int) -> tuple[int, int]:
    """(`resident` rounded down to whole pages and mapping units, `rows` rounded up to units)."""
    unit = row_unit(row_bytes, granularity)
    step = unit * page_size // math.gcd(unit, page_size)
    resident = resident // step * step
    return resident, -(-rows // unit) * unit


def granularity(device: torch.device) -> int:
    """Bytes each mapped piece must be a multiple of on `device`."""
    return _CudaMapper(device).granularity if device.type == "cuda" else _HostMapper.granularity


class LayerViews:
    """`views[l]`: layer l's `(2, rows, *row_shape)` buffer (see the module docstring)."""

    def __init__(self, layers: int, depth: int, resident: int, rows: int,
                 row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        elem = torch.empty((), dtype=dtype).element_size()
        row_bytes = math.prod(row_shape) * elem
        mapper = _CudaMapper(device) if device.type == "cuda" else _HostMapper()
        if resident <= 0 or resident >= rows:
            raise ValueError(f"resident rows must be in (0, {rows}); got {resident}")
        for n in (resident, rows - resident):
            if n * row_bytes % mapper.granularity:
                raise ValueError(f"{n} rows of {row_bytes} bytes are not a multiple of the "
                                 f"mapping granularity {mapper.granularity}; use aligned_rows")
        self.layers, self.depth, self.resident, self.rows = layers, depth, resident, rows
        res_bytes, stage_bytes = resident * row_bytes, (rows - resident) * row_bytes
        own = [[mapper.piece(res_bytes) for _ in range(2)] for _ in range(layers)]
        shared = [[mapper.piece(stage_bytes) for _ in range(2)] for _ in range(depth)]
        self.views = []
        for layer in range(layers):
            layout = []
            for half in range(2):
                layout += [own[layer][half], shared[layer % depth][half]]
            raw = mapper.view(layout)
            self.views.append(raw.view(dtype).view(2, rows, *row_shape))
        self.local_bytes = 2 * (layers * res_bytes + depth * stage_bytes)
        self._mapper = mapper

    def staging(self, stage: int) -> torch.Tensor:
        """The shared rows of staging buffer `stage` (seen through its first layer's buffer)."""
        return self.views[stage][:, self.resident:]


# ---- CPU: memfd pieces mapped into reserved address ranges -----------------------------------
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


class _HostMapper:
    """Pieces are ranges of one memfd (grown as pieces are asked for); a view reserves address
    space and maps its pieces over it with MAP_FIXED | MAP_SHARED, so every view of a piece
    sees the same bytes. The mappings live as long as the tensors made from them."""

    granularity = mmap.PAGESIZE

    def __init__(self) -> None:
        self._libc = _libc()
        self._fd = os.memfd_create("swiftcache-layer-views", os.MFD_CLOEXEC)
        self._size = 0
        weakref.finalize(self, os.close, self._fd)  # each mapping keeps the memory itself

    def piece(self, nbytes: int) -> tuple[int, int]:
        offset, self._size = self._size, self._size + nbytes
        os.ftruncate(self._fd, self._size)
        return offset, nbytes

    def view(self, pieces: list[tuple[int, int]]) -> torch.Tensor:
        total = sum(n for _, n in pieces)
        libc = self._libc
        base = libc.mmap(None, total, _PROT_NONE,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0),
                         -1, 0)
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"cannot reserve {total} bytes of address space")
        at = base
        for offset, n in pieces:
            got = libc.mmap(at, n, _PROT_RW, mmap.MAP_SHARED | 0x10, self._fd, offset)  # FIXED
            if got != at:
                libc.munmap(base, total)
                raise OSError(ctypes.get_errno(), f"cannot map {n} bytes of KV at {at:#x}")
            at += n
        buf = (ctypes.c_uint8 * total).from_address(base)
        weakref.finalize(buf, libc.munmap, base, total)  # torch.frombuffer keeps `buf` alive
        return torch.frombuffer(buf, dtype=torch.uint8)


# ---- GPU: CUDA virtual memory management ------------------------------------------------------
class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_ALLOCATION_PINNED, _LOCATION_DEVICE, _ACCESS_RW = 1, 1, 3


class _CudaMapper:
    """Pieces are `cuMemCreate` allocations on the pool's device; a view reserves a virtual
    range and maps its pieces over it (a piece may be mapped into many ranges)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device.index if device.index is not None else torch.cuda.current_device()
        torch.zeros(1, device=f"cuda:{self.device}")  # the device's primary context is current
        self._cu = ctypes.CDLL("libcuda.so.1")
        self._prop = _AllocationProp(type=_ALLOCATION_PINNED,
                                     location=_Location(_LOCATION_DEVICE, self.device))
        size = ctypes.c_size_t()
        self._check(self._cu.cuMemGetAllocationGranularity(ctypes.byref(size),
                                                           ctypes.byref(self._prop), 0),
                    "cuMemGetAllocationGranularity")
        self.granularity = size.value
        self._access = _AccessDesc(_Location(_LOCATION_DEVICE, self.device), _ACCESS_RW)

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed with CUDA driver error {code}")

    def piece(self, nbytes: int) -> tuple[int, int]:
        handle = ctypes.c_ulonglong()
        self._check(self._cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(nbytes),
                                         ctypes.byref(self._prop), ctypes.c_ulonglong(0)),
                    f"cuMemCreate of {nbytes} bytes")
        # Released now: the memory lives until the last range mapping it is unmapped.
        weakref.finalize(self, self._cu.cuMemRelease, handle)
        return handle.value, nbytes

    def view(self, pieces: list[tuple[int, int]]) -> torch.Tensor:
        total = sum(n for _, n in pieces)
        base = ctypes.c_ulonglong()
        cu = self._cu
        self._check(cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(total),
                                           ctypes.c_size_t(self.granularity),
                                           ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)),
                    f"cuMemAddressReserve of {total} bytes")
        at = base.value
        for handle, n in pieces:
            self._check(cu.cuMemMap(ctypes.c_ulonglong(at), ctypes.c_size_t(n),
                                    ctypes.c_size_t(0), ctypes.c_ulonglong(handle),
                                    ctypes.c_ulonglong(0)), "cuMemMap")
            at += n
        self._check(cu.cuMemSetAccess(ctypes.c_ulonglong(base.value), ctypes.c_size_t(total),
                                      ctypes.byref(self._access), ctypes.c_size_t(1)),
                    "cuMemSetAccess")
        owner = _DeviceRange(base.value, total, self.device)
        weakref.finalize(owner, _unmap_range, cu, base.value, total)
        return torch.as_tensor(owner, device=f"cuda:{self.device}")


def _unmap_range(cu, base: int, total: int) -> None:
    cu.cuMemUnmap(ctypes.c_ulonglong(base), ctypes.c_size_t(total))
    cu.cuMemAddressFree(ctypes.c_ulonglong(base), ctypes.c_size_t(total))


class _DeviceRange:
    """A mapped device range as torch reads one (`__cuda_array_interface__`, bytes)."""

    def __init__(self, ptr: int, nbytes: int, device: int) -> None:
        self.device = device
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}
