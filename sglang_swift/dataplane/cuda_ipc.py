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


def device_label(device: torch.device) -> str:
    """The donor's device as a grant names it: `cuda:<index>@<uuid>` (the index is the one its
    CUDA IPC handle opens on; the uuid says which physical GPU that is), or `cpu`."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index}@{torch.cuda.get_device_properties(index).uuid}"


FIX = ("launch every SwiftCache server of the node with all its GPUs visible (the same "
       "CUDA_VISIBLE_DEVICES, or none) and pick each server's GPU with --base-gpu-id")


def check_reachable(label: str, local: torch.device) -> int:
    """Where this process can read donor memory on device `label` (`device_label`) from its
    own device `local`: returns this process's index of the donor's GPU, found by its UUID (the
    two processes may number their GPUs differently, e.g. under different
    CUDA_VISIBLE_DEVICES); across GPUs peer access must exist. Raises
    MappingError("unreachable", why and the fix) when it cannot."""
    if not label.startswith("cuda:"):
        return -1
    index_text, _, uuid = label[len("cuda:"):].partition("@")
    try:
        index = int(index_text)
    except ValueError:
        raise MappingError("bad_descriptor",
                           f"donor device {label!r} is not cuda:<index>@<uuid>") from None
    if not torch.cuda.is_available():
        raise MappingError("unreachable", f"the donor's memory is on {label}, and this process "
                           f"sees no CUDA device")
    count = torch.cuda.device_count()
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
    if uuid:
        if uuid not in uuids:
            raise MappingError("unreachable", f"the donor's GPU {uuid} is not one of the {count} "
                               f"GPU(s) this process sees: {FIX}")
        here = uuids.index(uuid)
    elif index < count:  # a label without a UUID: the same numbering is assumed
        here = index
    else:
        raise MappingError("unreachable", f"the donor's memory is on its GPU {index}, but this "
                           f"process sees {count} GPU(s): {FIX}")
    mine = local.index if local.index is not None else torch.cuda.current_device()
    if mine != here and not torch.cuda.can_device_access_peer(mine, here):
        raise MappingError("unreachable", f"no peer access from GPU {mine} to the donor's GPU "
                           f"{here} (no NVLink or PCIe P2P between them): this borrower and "
                           f"that donor cannot share memory; place them on GPUs with peer "
                           f"access")
    return here


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


def open_handle(handle: bytes, total: int, device_index: int | None = None) -> torch.Tensor:
    """Map a donor's region from its handle, on this process's GPU `device_index` (the donor's
    GPU as numbered here, `check_reachable`; None: the index the donor used); MappingError when
    that is impossible."""
    if not torch.cuda.is_available():
        raise MappingError("unsupported", "a cuda_ipc descriptor needs CUDA in the borrower")
    fields = _unpack_fields(handle)
    if len(fields) != 9:
        raise MappingError("bad_descriptor", f"CUDA IPC handle has {len(fields)} fields, want 9")
    *share, tensor_offset = fields
    if device_index is not None and device_index >= 0:
        share[0] = device_index  # the handle opens on the device that holds it, as seen here
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
