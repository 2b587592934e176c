"""Copy rows by index pairs: `dst[dst_rows[i]] = src[src_rows[i]]` for every i.

The pool-lease transfers (sglang_swift/dataplane/pool_transfer.py) reduce every copy between a
borrower's pool and a donor's lent pages to this one operation over "unit" rows. Three
implementations, chosen by `backend`:
  "reference"  `index_select` then `index_copy_` (a temporary; any devices, obviously right);
  "staged"     CPU: the same two passes in steps through a reused staging buffer, so no fresh
               temporary page-faults and the gathered rows are still in cache when scattered;
               the scatter is numpy's fancy assignment of opaque records (one memcpy per row);
  "triton"     one pass: each program moves one chunk of one row (src and dst on one GPU; on
               CPU only under TRITON_INTERPRET=1, for tests).
`copy_rows` validates once and raises ValueError naming the problem before anything is written.
"""

from __future__ import annotations

import torch

BACKENDS = ("reference", "staged", "triton")
TRITON_BLOCK = 1024  # elements per program along a row


def check_rows(src, src_rows, dst, dst_rows) -> None:
    """Both sides 2-D, contiguous, same dtype and row width; index vectors 1-D int64 of one
    length on their side's device, within range; no destination row twice."""
    for tag, t in (("src", src), ("dst", dst)):
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{tag} must be a contiguous 2-D [rows, width] tensor, got "
                             f"{tuple(t.shape)} strides {t.stride()}")
    if src.dtype != dst.dtype or src.shape[1] != dst.shape[1]:
        raise ValueError(f"src {src.dtype} rows of {src.shape[1]} and dst {dst.dtype} rows of "
                         f"{dst.shape[1]} differ")
    for tag, idx, t in (("src_rows", src_rows, src), ("dst_rows", dst_rows, dst)):
        if idx.dim() != 1 or idx.dtype != torch.int64 or idx.device != t.device:
            raise ValueError(f"{tag} must be 1-D int64 on {t.device}, got {idx.dtype} "
                             f"{tuple(idx.shape)} on {idx.device}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= t.shape[0]):
            raise ValueError(f"{tag} span [{int(idx.min())}, {int(idx.max())}] outside "
                             f"{t.shape[0]} rows")
    if src_rows.numel() != dst_rows.numel():
        raise ValueError(f"{src_rows.numel()} source rows but {dst_rows.numel()} destinations")
    if dst_rows.unique().numel() != dst_rows.numel():
        raise ValueError("a destination row repeats; the result would depend on the order")


def copy_rows(src, src_rows, dst, dst_rows, *, backend: str = "reference",
              staging: torch.Tensor | None = None, validate: bool = True) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]]. `staging` ("staged" only): a CPU uint8 buffer of at
    least one row, reused between calls. `validate=False` skips the checks, for a caller that
    checked the same arguments already (once per transfer, not once per layer)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    if validate:
        check_rows(src, src_rows, dst, dst_rows)
    if src_rows.numel() == 0:
        return
    if backend == "reference":
        dst.index_copy_(0, dst_rows, src.index_select(0, src_rows).to(dst.device))
    elif backend == "staged":
        _staged(src, src_rows, dst, dst_rows, staging)
    else:
        if src.device != dst.device:
            raise ValueError(f"backend 'triton' copies within one device, got {src.device} -> "
                             f"{dst.device}; use 'reference' across devices")
        if src.dtype.is_complex or src.dtype.itemsize > 8:
            raise ValueError(f"backend 'triton' moves rows of 8-byte or smaller elements, got "
                             f"{src.dtype}; view the bytes as int64")
        from .row_copy_triton import launch_copy_rows

        launch_copy_rows(src, src_rows, dst, dst_rows, TRITON_BLOCK)


def _staged(src, src_rows, dst, dst_rows, staging) -> None:
    if src.device.type != "cpu" or dst.device.type != "cpu":
        raise ValueError("backend 'staged' is the CPU path; use 'triton' or 'reference' on CUDA")
    row_bytes = src.shape[1] * src.element_size()
    if staging is None or staging.numel() < row_bytes:
        staging = torch.empty(max(row_bytes, 2 << 20), dtype=torch.uint8)
    stage = staging[: staging.numel() // row_bytes * row_bytes].view(src.dtype).view(
        -1, src.shape[1])
    step, n = stage.shape[0], src_rows.shape[0]
    dst_records, dst_at = _records(dst), dst_rows.numpy()
    for s in range(0, n, step):
        part = stage[: min(step, n - s)]
        torch.index_select(src, 0, src_rows[s: s + step], out=part)
        # numpy's fancy assignment of opaque records is one memcpy per row; torch's index_copy_
        # moves elements (measured 2.5x slower for 32 KiB rows)
        dst_records[dst_at[s: s + step]] = _records(part)


def _records(rows: torch.Tensor):
    """[n, w] CPU rows (contiguous) as a numpy array of n opaque records sharing the memory."""
    import numpy as np

    raw = rows.view(torch.uint8).numpy()
    return raw.view(np.dtype((np.void, raw.shape[1])))[:, 0]
