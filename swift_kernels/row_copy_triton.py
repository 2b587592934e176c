"""Triton kernel for `row_copy.copy_rows`: one pass, no temporary. Imported only when used.

Program (r, c) moves elements [c x BLOCK, (c+1) x BLOCK) of row r: it reads src row
`src_rows[r]` and writes dst row `dst_rows[r]`. Row offsets are int64 (a donor pool of tens of
GB has more elements than int32 holds).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_rows_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, ROW: tl.constexpr,
                     BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    s = tl.load(src_rows_ptr + r).to(tl.int64)
    d = tl.load(dst_rows_ptr + r).to(tl.int64)
    x = tl.load(src_ptr + s * ROW + offs, mask=mask)
    tl.store(dst_ptr + d * ROW + offs, x, mask=mask)


def launch_copy_rows(src, src_rows, dst, dst_rows, block: int) -> None:
    row = src.shape[1]
    block = min(block, triton.next_power_of_2(row))
    grid = (src_rows.shape[0], triton.cdiv(row, block))
    copy_rows_kernel[grid](src, dst, src_rows, dst_rows, ROW=row, BLOCK=block,
                           num_warps=4 if block >= 512 else 1)
