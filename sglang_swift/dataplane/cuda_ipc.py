"""CUDA IPC for the arena: the handle a donor exports and how a borrower opens it.

The handle is torch's own IPC share of the region's allocation (the cudaIpcMemHandle, plus the
ref-counter and event torch uses to keep the allocation alive and ordered), encoded as
length-prefixed fields: no pickle on the wire. A borrower on another GPU opens it on the donor's
device; copies and Triton kernels then read it over the peer link where peer access exists.
"""

from __future__ import annotations

import struct

import torch

from .sharing import MappingError


def export_handle(region: torch.Tensor) -> bytes:
    share = region.untyped_storage()._share_cuda_()  # noqa: SLF001
    return _pack_fields(list(share) + [region.storage_offset()])


def _pack_fields(fields) -> bytes:
    out = bytearray()
    for f in fields:
        if f is None:
            out += b"n"
        elif isinstance(f, bool):
            out += b"t" + bytes([f])
        elif isinstance(f, int):
            out += b"i" + struct.pack("<q", f)
        else:
            f = bytes(f)
            out += b"b" + struct.pack("<I", len(f)) + f
    return bytes(out)


def _unpack_fields(data: bytes) -> list:
    out, i = [], 0
    while i < len(data):
        tag = data[i : i + 1]
        i += 1
        if tag == b"n":
            out.append(None)
        elif tag == b"t":
            out.append(bool(data[i]))
            i += 1
        elif tag == b"i":
            out.append(struct.unpack_from("<q", data, i)[0])
            i += 8
        elif tag == b"b":
            (n,) = struct.unpack_from("<I", data, i)
            out.append(data[i + 4 : i + 4 + n])
            i += 4 + n
        else:
            raise MappingError("bad_descriptor", f"corrupt CUDA IPC handle at byte {i - 1}")
    return out


def open_handle(handle: bytes, total: int) -> torch.Tensor:
    """Map a donor's region from its handle; MappingError when that is impossible."""
    if not torch.cuda.is_available():
        raise MappingError("unsupported", "a cuda_ipc descriptor needs CUDA in the borrower")
    fields = _unpack_fields(handle)
    if len(fields) != 9:
        raise MappingError("bad_descriptor", f"CUDA IPC handle has {len(fields)} fields, want 9")
    *share, tensor_offset = fields
    try:
        torch.cuda._lazy_init()  # noqa: SLF001
        storage = torch.UntypedStorage._new_shared_cuda(*share)  # noqa: SLF001
    except RuntimeError as e:
        raise MappingError("not_found", f"CUDA IPC open failed ({e}); the donor may be gone") from e
    if storage.nbytes() - tensor_offset < total:
        raise MappingError(
            "size",
            f"IPC allocation holds {storage.nbytes() - tensor_offset} "
            f"bytes, descriptor says {total}",
        )
    region = torch.empty(0, dtype=torch.uint8, device=storage.device)
    region.set_(storage, tensor_offset, (total,), (1,))
    return region
