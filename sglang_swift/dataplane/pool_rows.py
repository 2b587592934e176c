"""The rows a pool-lease copy moves, and how (helpers of `pool_transfer.PoolTransferEngine`).

`resolve_backend` picks the row-copy path for a pair of devices, `unit_rows` views flat bytes as
rows of the widest word the pointers allow, `index_to_device` moves an index tensor to the lane
that reads it, and `check_buffers` validates a borrower's per-layer buffers (K and V, or an MLA
pool's latent ones) against its geometry. Shared by the pool-lease engine and the layer stream's
donor lease.
"""

from __future__ import annotations

import torch

import swift_kernels as sk

_WIDTHS = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16),
           (1, torch.uint8))
# CPU: a layer moves through a staging buffer this big, reused, so the gathered rows are still in
# cache when they are scattered and no fresh (page-faulting) temporary is allocated per layer.
# Sized by a measurement (2 cores, 256 MiB moved in 32 KiB units): one temporary per op
# 1.0 GB/s, 1 MiB staging 5.8, 4 MiB 6.2 (a plain copy 9.2): 2 MiB gets most of it and stays
# within a core's share of a last-level cache.
STAGING_BYTES = 2 << 20


def resolve_backend(backend: str, local: torch.device, donor: torch.device) -> str:
    """`auto`: "staged" on CPU, "triton" (one pass) within one GPU, "reference" (gather, copy,
    scatter) between two devices (two GPUs, or host memory and a GPU)."""
    if backend == "auto":
        if local.type == "cpu" and donor.type == "cpu":
            return "staged"
        return "triton" if local == donor and sk.triton_available() else "reference"
    if backend not in sk.row_copy.BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use auto or one of "
                         f"{sk.row_copy.BACKENDS}")
    if backend == "triton" and local != donor:
        raise ValueError(f"backend 'triton' needs both pools on one device, got {local} and "
                         f"{donor}")
    return backend


def index_to_device(t: torch.Tensor, device: torch.device, stream) -> torch.Tensor:
    """An index tensor onto `device` for the lane stream `stream` that will read it. GPU: copied
    from pinned memory on that stream without blocking, so the host does not wait for the
    compute stream to reach a pageable copy, and the copy is ordered before the lane's reads
    by the stream itself (torch's pinned allocator keeps the host block until the copy ran,
    and the device tensor belongs to `stream`, so its memory is not reused before). A tensor
    already on the device (SGLang's slot indices, and what was computed from them on the
    compute stream) stays there: `stream` is recorded on it, so its memory is not reused
    before the lane read it."""
    if device.type != "cuda":
        return t
    if t.device.type == "cuda":
        if stream is not None:
            t.record_stream(stream)
        return t
    with torch.cuda.stream(stream):
        return t.pin_memory().to(device, non_blocking=True)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto `device` without the host waiting for the device: on a GPU from
    pinned memory, asynchronously on the current stream (torch's pinned allocator keeps the
    host block until the copy ran); on CPU the same call, a no-op."""
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def unit_rows(flat: torch.Tensor, unit: int, align: int, max_width: int = 16) -> torch.Tensor:
    """`flat` (1-D uint8) as `[len // unit, unit]` rows of the widest element (at most
    `max_width` bytes) that divides the unit and `align` (the pointers' common alignment): wide
    rows make index copies move words, not bytes (16-byte rows run as memcpy on CPU)."""
    width, dtype = next((w, d) for w, d in _WIDTHS
                        if w <= max_width and unit % w == 0 and align % w == 0)
    usable = flat.numel() // unit * unit
    return flat[:usable].view(dtype).view(-1, unit // width)


def check_buffers(g, k_buffers, v_buffers) -> None:
    """ValueError unless `k_buffers` / `v_buffers` are the per-layer NHD buffers of `g` (a latent
    page: its latent buffers, and no V buffers), contiguous, all on one device."""
    want_v = 0 if g.latent else g.num_layers
    if len(k_buffers) != g.num_layers or len(v_buffers) != want_v:
        raise ValueError(f"the borrower's geometry has {g.num_layers} layers and {want_v} V "
                         f"buffers, got {len(k_buffers)} K and {len(v_buffers)} V buffers")
    k0 = k_buffers[0]
    shapes = ((k_buffers, g.head_dim, "K"), (v_buffers, g.v_head_dim, "V"))
    for buffers, dim, name in shapes:
        for layer, buf in enumerate(buffers):
            if tuple(buf.shape) != (k0.shape[0], g.num_kv_heads, dim) or buf.dtype != g.dtype:
                raise ValueError(f"layer {layer}: {name} buffer {buf.dtype} {tuple(buf.shape)} "
                                 f"does not match {g} with {k0.shape[0]} rows")
            if not buf.is_contiguous():
                raise ValueError(f"layer {layer}: {name} must be a contiguous NHD buffer")
            if buf.device != k0.device:
                raise ValueError(f"layer {layer}'s {name} buffer is on {buf.device}, layer 0's "
                                 f"K on {k0.device}; every layer must be on one device")
