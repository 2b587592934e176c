"""The one way SwiftCache shares memory between processes: a donor exports a region once
(`SharedArena`); a borrower maps it from the descriptor a lease grant carries (`map_arena`).

A lending server's SGLang KV pool lives in such a region (integration/shared_kv_pool.py places
it; `pool_lease.map_pool` maps it with the pool's layout). CPU: POSIX shared memory (so CI
exercises a real cross-process path). CUDA: a CUDA IPC handle of the region's allocation (torch's
own IPC sharing); a borrower on another GPU maps it on the donor's device and reads it over the
peer link where peer access exists.

The region starts with a 4 KiB header (magic, version, sizes, owner pid and uuid, a revoked
flag) so a borrower can check it mapped the region it was promised; the data follows it. A failed or
revoked mapping raises MappingError with a `reason`: an expected event the caller handles (fall
back to host memory or recompute), not a crash.
"""

from __future__ import annotations

import mmap
import os
import struct
import uuid as uuid_mod
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from ..common.private_resources import shm_name
from ..common.process import process_alive
from .block_size import BLOCK_ALIGN_BYTES

HEADER_BYTES = 4096  # a multiple of BLOCK_ALIGN_BYTES, so the blocks after it stay aligned
_MAGIC = b"SWIFTARN"
_VERSION = 1
# magic, version, revoked, block_bytes, num_blocks, owner pid, owner uuid
_HEADER = struct.Struct("<8sIIQQQ48s")
DESCRIPTOR_KEYS = (
    "kind",
    "handle",
    "device",
    "total_bytes",
    "block_bytes",
    "num_blocks",
    "owner_pid",
    "owner_uuid",
)


class MappingError(RuntimeError):
    """The region could not be mapped or is no longer valid. `reason` is one of:
    bad_descriptor, not_found, owner_dead, size, identity, revoked, unsupported, unreachable
    (this process cannot read the donor's device: `cuda_ipc.check_reachable`)."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


owner_alive = process_alive  # the donor process of an arena is alive


def _pack_header(block_bytes, num_blocks, pid, owner_uuid, revoked=0) -> bytes:
    raw = _HEADER.pack(_MAGIC, _VERSION, revoked, block_bytes, num_blocks, pid, owner_uuid.encode())
    return raw.ljust(HEADER_BYTES, b"\0")


def _unpack_header(raw: bytes) -> dict:
    magic, ver, revoked, bb, nb, pid, uid = _HEADER.unpack_from(raw)
    return {
        "magic": magic,
        "version": ver,
        "revoked": revoked,
        "block_bytes": bb,
        "num_blocks": nb,
        "owner_pid": pid,
        "owner_uuid": uid.rstrip(b"\0").decode(),
    }


def _desc_get(desc, key):
    if isinstance(desc, dict):
        if key not in desc:
            raise MappingError("bad_descriptor", f"descriptor lacks {key!r}")
        return desc[key]
    if not hasattr(desc, key):
        raise MappingError("bad_descriptor", f"descriptor lacks {key!r}")
    return getattr(desc, key)


class SharedArena:
    """A region of `size_bytes` other processes can map, after a header: a lending server's KV
    pool (`integration/shared_kv_pool.py`; its `PoolLayout` travels in the descriptor beside
    it). It holds the memory only; who owns each page is the donor's `DonorLedger`
    (control/ledger.py), which the donor's agent keeps. The header and descriptor keep the
    region's size as one block of `size_bytes` (`block_bytes`, `num_blocks` == 1)."""

    def __init__(self, size_bytes: int, device: str = "cpu", name_prefix: str = "swift"):
        if size_bytes <= 0 or size_bytes % BLOCK_ALIGN_BYTES:
            raise ValueError(
                f"a shared region needs a size that is a positive multiple of "
                f"{BLOCK_ALIGN_BYTES} bytes, got {size_bytes}; round it up to BLOCK_ALIGN_BYTES"
            )
        num_blocks, block_bytes = 1, size_bytes
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.device = torch.device(device)
        self.owner_uuid = str(uuid_mod.uuid4())
        self.owner_pid = os.getpid()
        self.total_bytes = HEADER_BYTES + num_blocks * block_bytes
        self._shm = None
        header = torch.frombuffer(
            bytearray(_pack_header(block_bytes, num_blocks, self.owner_pid, self.owner_uuid)),
            dtype=torch.uint8,
        )
        if self.device.type == "cpu":
            name = shm_name(name_prefix)  # per user and pid: swept once this process is gone
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=self.total_bytes)
            self.region = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=self.total_bytes)
        elif self.device.type == "cuda":
            self.region = torch.empty(self.total_bytes, dtype=torch.uint8, device=self.device)
        else:
            raise ValueError(f"arena device must be cpu or cuda, got {device}")
        self.region[:HEADER_BYTES].copy_(header)
        self.memory = self.region[HEADER_BYTES:]  # the region's bytes after the header (uint8)
        try:
            self._handle = self._make_handle()
        except BaseException:  # an export that fails leaves no shared name behind
            self.close()
            raise

    def _make_handle(self) -> bytes:
        if self._shm is not None:
            return self._shm.name.encode()
        from .cuda_ipc import export_handle

        return export_handle(self.region)

    def _device_label(self) -> str:
        if self._shm is not None:
            return str(self.device)
        from .cuda_ipc import device_label

        return device_label(torch.device(self.device))

    def export(self) -> dict:
        """The MemoryDescriptor a lease grant carries, as a plain dict (the protocol's keys)."""
        return {
            "kind": "shm" if self._shm is not None else "cuda_ipc",
            "handle": self._handle,
            "device": self._device_label(),
            "total_bytes": self.total_bytes,
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
            "owner_pid": self.owner_pid,
            "owner_uuid": self.owner_uuid,
        }

    def revoke_export(self) -> None:
        """Mark the region revoked: mapped borrowers see it at their next check(); on CPU the
        name is unlinked too, so no new mapping succeeds."""
        self.region[:HEADER_BYTES].copy_(
            torch.frombuffer(
                bytearray(
                    _pack_header(
                        self.block_bytes,
                        self.num_blocks,
                        self.owner_pid,
                        self.owner_uuid,
                        1,
                    )
                ),
                dtype=torch.uint8,
            )
        )
        if self._shm is not None:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Release the region (and unlink the shared-memory name). Idempotent."""
        self.memory = self.region = None
        if self._shm is not None:
            shm, self._shm = self._shm, None
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
            try:
                shm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes when it is collected


@dataclass
class MappedArena:
    """A borrower's view of a donor's region. `memory` is its uint8 bytes after the header."""

    descriptor: dict
    memory: torch.Tensor
    region: torch.Tensor
    _shm: object = None

    def header(self) -> dict:
        return _unpack_header(bytes(self.region[:HEADER_BYTES].cpu().numpy()))

    def check(self, read_header: bool | None = None) -> None:
        """Raise MappingError if the donor revoked the arena or its process is gone.

        The revoked flag lives in the region's header; reading it from GPU memory would
        synchronize the device, so on CUDA only the (host-side) owner check runs unless
        `read_header=True`."""
        if not owner_alive(self.descriptor["owner_pid"]):
            raise MappingError("owner_dead", f"donor pid {self.descriptor['owner_pid']} is gone")
        if read_header is None:
            read_header = self.region.device.type == "cpu"
        if read_header and self.header()["revoked"]:
            raise MappingError("revoked", "the donor revoked this arena; stop using its blocks")

    def alive(self) -> bool:
        try:
            self.check()
        except MappingError:
            return False
        return True

    def close(self) -> None:
        self.memory = self.region = None
        if self._shm is not None:
            shm, self._shm = self._shm, None
            try:
                shm.close()
            except BufferError:
                pass


def _open_shm(name: str) -> mmap.mmap:
    """Map a donor's shared memory. Opened directly (not through multiprocessing.SharedMemory)
    so no resource tracker ever unlinks the donor's segment."""
    import _posixshmem

    try:
        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    except FileNotFoundError as e:
        raise MappingError(
            "not_found", f"shared memory {name!r} is gone (revoked or the donor exited)"
        ) from e
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def map_arena(desc, cuda_index: int | None = None) -> MappedArena:
    """Map a donor's region from its descriptor (a dict or any object with the protocol's
    attributes); checks sizes and owner identity, raises MappingError on failure. A CUDA region
    opens on this process's GPU `cuda_index` (`cuda_ipc.check_reachable`; None: the donor's
    own index)."""
    d = {k: _desc_get(desc, k) for k in DESCRIPTOR_KEYS}
    try:
        nb, bb, total = int(d["num_blocks"]), int(d["block_bytes"]), int(d["total_bytes"])
    except (TypeError, ValueError) as e:
        raise MappingError("bad_descriptor", f"non-integer size fields: {e}") from e
    if nb <= 0 or bb <= 0 or bb % BLOCK_ALIGN_BYTES or total != HEADER_BYTES + nb * bb:
        raise MappingError(
            "bad_descriptor",
            f"inconsistent sizes: total_bytes={total}, num_blocks={nb}, block_bytes={bb}",
        )
    if not owner_alive(int(d["owner_pid"])):
        raise MappingError("owner_dead", f"donor pid {d['owner_pid']} is not running")
    shm = None
    if d["kind"] == "shm":
        shm = _open_shm(bytes(d["handle"]).decode())
        if (size := len(shm)) < total:
            shm.close()
            raise MappingError(
                "size", f"shared memory holds {size} bytes, descriptor says {total}"
            )
        region = torch.frombuffer(shm, dtype=torch.uint8, count=total)
    elif d["kind"] == "cuda_ipc":
        from .cuda_ipc import open_handle

        region = open_handle(bytes(d["handle"]), total, cuda_index)
    else:
        raise MappingError(
            "unsupported", f"descriptor kind {d['kind']!r}; expected shm or cuda_ipc"
        )
    mapped = MappedArena(d, region[HEADER_BYTES:HEADER_BYTES + nb * bb], region, shm)
    h = mapped.header()
    problems = [
        f"{k}: header {h[k]!r} != descriptor {d[k]!r}"
        for k in ("block_bytes", "num_blocks", "owner_pid", "owner_uuid")
        if h[k] != d[k]
    ]
    if h["magic"] != _MAGIC or h["version"] != _VERSION:
        problems.insert(0, f"not a SwiftCache arena (magic {h['magic']!r}, version {h['version']})")
    if problems:
        mapped.close()
        raise MappingError("identity", "; ".join(problems))
    if h["revoked"]:
        mapped.close()
        raise MappingError("revoked", "the donor revoked this arena before it was mapped")
    return mapped


def unlink_descriptor(desc) -> bool:
    """Remove a CPU arena's shared-memory name after its donor died without cleaning up (the
    donor normally unlinks it in close()). True if something was removed."""
    if _desc_get(desc, "kind") != "shm":
        return False
    import _posixshmem

    try:
        _posixshmem.shm_unlink("/" + bytes(_desc_get(desc, "handle")).decode().lstrip("/"))
    except FileNotFoundError:
        return False
    return True
