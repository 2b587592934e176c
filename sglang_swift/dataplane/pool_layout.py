"""Where each page of a live SGLang KV pool lives in its shared region (the donor's own pool).

A lending server's `MHATokenToKVPool` buffers are views of one shareable region (see
`integration/shared_kv_pool.py`). The region is layer-major, with SGLang's NHD shapes:

    region = [header][layer 0][layer 1]...[layer L-1]
    layer  = K rows (padded_rows x heads x head_dim) then V rows (padded_rows x heads x v_head_dim)

so the K bytes of pool page `p` in layer `l` start at
`data_offset + l * layer_stride + p * page_size * k_row_bytes` and are contiguous for one page
(`k_chunk_bytes`); V likewise after `v_offset`. When K and V have the same shape this is exactly
SGLang's fused `(2, padded_rows, H, D)` allocation per layer. Every address is O(1) arithmetic:
no per-layer or per-block table travels to the borrower, only this record.
The page's shape is the project's one `KVGeometry` (`geometry`); this record adds where the
pool's rows sit in its region.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

import torch

from swift_kernels import KVGeometry
from swift_kernels.geometry import dtype_from_name as dtype_of
from swift_kernels.geometry import dtype_name

__all__ = ["PoolLayout", "dtype_name", "dtype_of"]


@dataclass(frozen=True)
class PoolLayout:
    """The byte layout of one server's KV pool region; see the module docstring."""

    num_layers: int
    rows: int  # token slots SGLang uses (size + page_size)
    padded_rows: int  # rows rounded up to whole pages
    head_num: int
    head_dim: int
    v_head_dim: int
    dtype: str  # storage dtype name, e.g. "float32"
    page_size: int
    data_offset: int = 0  # bytes from the region start to layer 0 (after a header)

    def __post_init__(self) -> None:
        for name in ("num_layers", "rows", "padded_rows", "head_num", "head_dim", "v_head_dim",
                     "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PoolLayout.{name} must be > 0, got {getattr(self, name)}")
        if self.padded_rows < self.rows or self.padded_rows % self.page_size:
            raise ValueError(f"padded_rows {self.padded_rows} must be >= rows {self.rows} and a "
                             f"multiple of page_size {self.page_size}")
        dtype_of(self.dtype)

    @cached_property
    def geometry(self) -> KVGeometry:
        """The shape of one page of this pool (what a borrower's page is compared against)."""
        return KVGeometry(self.num_layers, self.head_num, self.head_dim, self.v_head_dim,
                          self.dtype, self.page_size)

    @property
    def itemsize(self) -> int:
        return dtype_of(self.dtype).itemsize

    @property
    def k_row_bytes(self) -> int:
        return self.geometry.k_row_elems * self.itemsize

    @property
    def v_row_bytes(self) -> int:
        return self.geometry.v_row_elems * self.itemsize

    @property
    def v_offset(self) -> int:
        """Bytes from a layer's start to its V rows."""
        return self.padded_rows * self.k_row_bytes

    @property
    def layer_stride(self) -> int:
        return self.padded_rows * (self.k_row_bytes + self.v_row_bytes)

    @property
    def data_bytes(self) -> int:
        return self.num_layers * self.layer_stride

    @property
    def num_pages(self) -> int:
        return self.padded_rows // self.page_size

    def chunk_bytes(self, half: int) -> int:
        """Bytes of one page of one layer's K (half 0) or V (half 1)."""
        return self.page_size * (self.k_row_bytes if half == 0 else self.v_row_bytes)

    def chunk_offset(self, page: int, layer: int, half: int) -> int:
        """Byte offset in the region of page `page`, layer `layer`, K (0) or V (1)."""
        if not (0 <= page < self.num_pages and 0 <= layer < self.num_layers and half in (0, 1)):
            raise IndexError(f"page {page} / layer {layer} / half {half} outside {self}")
        row_bytes = self.k_row_bytes if half == 0 else self.v_row_bytes
        return (self.data_offset + layer * self.layer_stride + half * self.v_offset
                + page * self.page_size * row_bytes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "PoolLayout":
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"bad pool layout {data!r}: {exc}") from None

    def views(self, region: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """SGLang-shaped per-layer K and V tensors (rows x heads x dim) over `region` (uint8)."""
        if region.dtype != torch.uint8 or region.dim() != 1:
            raise ValueError("region must be a flat uint8 tensor")
        if region.numel() < self.data_offset + self.data_bytes:
            raise ValueError(f"region of {region.numel()} bytes is smaller than the pool's "
                             f"{self.data_offset + self.data_bytes}")
        dt = dtype_of(self.dtype)
        ks, vs = [], []
        for layer in range(self.num_layers):
            base = self.data_offset + layer * self.layer_stride
            k = region[base: base + self.v_offset].view(dt)
            v = region[base + self.v_offset: base + self.layer_stride].view(dt)
            ks.append(k.view(self.padded_rows, self.head_num, self.head_dim)[: self.rows])
            vs.append(v.view(self.padded_rows, self.head_num, self.v_head_dim)[: self.rows])
        return ks, vs
