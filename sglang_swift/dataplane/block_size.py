"""The alignment of every block of a shared region (`SharedArena`, sharing.py)."""

from __future__ import annotations

# Every block size is a multiple of this, and so is the region's header (sharing.HEADER_BYTES),
# so every block starts on a 512-byte boundary of a region that is itself at least that aligned
# (POSIX shared memory is page-aligned; PyTorch's CUDA allocator rounds to 512 bytes). Why 512:
# the row copies move words of up to 16 bytes (the CPU path's complex128 rows); 128 keeps a
# block from sharing a GPU cache line (64 a CPU line) with its neighbour; 512 covers both and
# matches the CUDA allocation granularity. A lending server's pool region rounds its size up to
# a multiple of it (integration/shared_kv_pool.py).
BLOCK_ALIGN_BYTES = 512
