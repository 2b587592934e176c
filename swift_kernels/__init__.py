"""The copy kernel the pool-lease transfers are built on, and the description of a KV page.

`copy_rows` (row_copy.py): `dst[dst_rows[i]] = src[src_rows[i]]` over rows of a fixed width, in
three implementations chosen by `backend`:
  "reference"  plain torch (`index_select` then `index_copy_`), obviously right: the oracle the
               tests compare the others against, and the path between two devices;
  "staged"     the CPU data path (a reused staging buffer, one memcpy per row);
  "triton"     one pass on a GPU (on CPU only under TRITON_INTERPRET=1, for tests).
`KVGeometry` (geometry.py) is the project's one description of a model's KV page. `copy_rows`
validates its arguments and raises ValueError naming the problem before anything is written.
Importing this package needs neither a GPU nor Triton: Triton is imported on first use.
"""

from __future__ import annotations

from . import row_copy
from .geometry import K, KVGeometry, V, dtype_from_name, dtype_name
from .row_copy import copy_rows

__all__ = [
    "K",
    "KVGeometry",
    "V",
    "copy_rows",
    "dtype_from_name",
    "dtype_name",
    "row_copy",
    "triton_available",
]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True
