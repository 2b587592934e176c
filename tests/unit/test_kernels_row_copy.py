"""swift_kernels.copy_rows, the row copy under every pool-lease transfer: the staged CPU path and
the Triton kernel (interpreted here) against the plain-torch reference."""

from __future__ import annotations

import os

import pytest
import torch

import swift_kernels as sk

POISON = 0x5A
needs_interpreter = pytest.mark.skipif(
    not sk.triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU tensors runs only under TRITON_INTERPRET=1")


def _case(dtype, rows: int, width: int, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (rows, width * dtype.itemsize), dtype=torch.uint8,
                        generator=gen).view(dtype)
    dst = torch.full((rows + 3, width * dtype.itemsize), POISON, dtype=torch.uint8).view(dtype)
    src_rows = torch.randint(0, rows, (n,), generator=gen)  # a source row may repeat
    dst_rows = torch.randperm(rows + 3, generator=gen)[:n]
    return src, src_rows, dst, dst_rows


@pytest.mark.parametrize("backend", ["staged", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("dtype,width", [(torch.int64, 300), (torch.int32, 7), (torch.uint8, 33),
                                         (torch.complex128, 64)])
def test_backends_match_the_reference_and_touch_only_named_rows(backend, dtype, width):
    """Invariant: every backend writes exactly dst[dst_rows[i]] = src[src_rows[i]] (bitwise, as
    the reference does) and leaves every other destination row as it was."""
    if backend == "triton" and dtype.is_complex:
        pytest.skip("Triton has no complex dtype; the engine gives it int64 rows")
    src, src_rows, dst, dst_rows = _case(dtype, 40, width, 29, seed=width)
    want = dst.clone()
    sk.copy_rows(src, src_rows, want, dst_rows, backend="reference")
    staging = torch.empty(3 * width * dtype.itemsize, dtype=torch.uint8)  # several steps
    sk.copy_rows(src, src_rows, dst, dst_rows, backend=backend, staging=staging)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
    untouched = torch.ones(dst.shape[0], dtype=torch.bool)
    untouched[dst_rows] = False
    assert bool((dst[untouched].view(torch.uint8) == POISON).all())


def test_staged_path_needs_no_staging_buffer_and_grows_a_small_one():
    """Invariant: without a staging buffer, or with one smaller than a row, the staged path
    still copies exactly."""
    src, src_rows, dst, dst_rows = _case(torch.int64, 12, 1024, 9, seed=1)
    want = dst.clone()
    sk.copy_rows(src, src_rows, want, dst_rows, backend="reference")
    for staging in (None, torch.empty(100, dtype=torch.uint8)):
        out = dst.clone()
        sk.copy_rows(src, src_rows, out, dst_rows, backend="staged", staging=staging)
        assert torch.equal(out, want)


def test_bad_arguments_are_refused_before_anything_is_written():
    """Invariant: mismatched widths or dtypes, non-contiguous sides, indices out of range or of
    the wrong kind, unequal lengths and a repeated destination raise ValueError; dst unchanged."""
    src, src_rows, dst, dst_rows = _case(torch.int32, 10, 4, 5, seed=2)
    before = dst.clone()
    bad = [
        ((src[:, :3].contiguous(), src_rows, dst, dst_rows), "differ"),
        ((src.view(torch.float32), src_rows, dst, dst_rows), "differ"),
        ((src.t(), src_rows, dst, dst_rows), "contiguous"),
        ((src, src_rows + 10, dst, dst_rows), "outside"),
        ((src, src_rows.int(), dst, dst_rows), "int64"),
        ((src, src_rows[:4], dst, dst_rows), "destinations"),
        ((src, src_rows, dst, torch.zeros(5, dtype=torch.int64)), "repeats"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            sk.copy_rows(*args, backend="staged")
    with pytest.raises(ValueError, match="unknown backend"):
        sk.copy_rows(src, src_rows, dst, dst_rows, backend="fast")
    assert torch.equal(dst, before)
