"""Where each page of a live SGLang KV pool lives in its shared region (the donor's own pool).

A lending server's pool buffers are views of one shareable region (see
`integration/shared_kv_pool.py`). Lending is bytes: the region is described by the bytes of one
token row per layer, for each of the layer's buffers, and never read as K or V heads by a
borrower. It is layer-major, with SGLang's shapes:

    region = [header][layer 0][layer 1]...[layer L-1]
    layer  = K rows (padded_rows x k_row_bytes) then V rows (padded_rows x v_row_bytes)

An `MHATokenToKVPool` is K rows `[heads, head_dim]` then V rows `[heads, v_head_dim]`
(`KVGeometry`); an `MLATokenToKVPool` keeps one latent buffer per layer, rows
`[1, kv_lora_rank + qk_rope_head_dim]` (a latent `KVGeometry`: K rows only, `v_row_bytes` 0).

so the K bytes of pool page `p` in layer `l` start at
`data_offset + l * layer_stride + p * page_size * k_row_bytes` and are contiguous for one page
(`chunk_bytes(K)`); V likewise after `v_offset`. When K and V have the same shape this is exactly
SGLang's fused `(2, padded_rows, H, D)` allocation per layer. Every address is O(1) arithmetic:
no per-layer or per-block table travels to the borrower, only this record.

The page's shape is `geometry` (a `KVGeometry`); this record adds only where the pool's rows sit
in its region. On the wire (`control.protocol.PoolLayoutMsg`) it is the flat field list of
`to_dict()` (a latent page: one head of the latent width, `v_head_dim` 0);
`from_dict()` converts back (a dict or the message struct).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swift_kernels import KVGeometry
from swift_kernels.geometry import K, V, dtype_name
from swift_kernels.geometry import dtype_from_name as dtype_of

__all__ = ["KVGeometry", "PoolLayout", "dtype_name", "dtype_of"]

# The wire's flat field names (PoolLayoutMsg) -> this record (the page's shape as a KVGeometry).
_GEOMETRY_FIELDS = {"num_layers": "num_layers", "head_num": "num_kv_heads",
                    "head_dim": "head_dim", "v_head_dim": "v_head_dim", "dtype": "dtype",
                    "page_size": "page_size"}
WIRE_FIELDS = ("num_layers", "rows", "padded_rows", "head_num", "head_dim", "v_head_dim",
               "dtype", "page_size", "data_offset")


@dataclass(frozen=True)
class PoolLayout:
    """The byte layout of one server's KV pool region; see the module docstring.

    `geometry` is one page of the pool (`KVGeometry`: layers, KV heads, head dims, dtype, page
    size; a latent one for one buffer per layer); `rows`
    the token slots SGLang uses (size + page_size), `padded_rows` those rounded up to whole
    pages, `data_offset` the bytes from the region start to layer 0."""

    geometry: KVGeometry
    rows: int
    padded_rows: int
    data_offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, KVGeometry):
            raise ValueError(f"PoolLayout.geometry must be a KVGeometry, got {self.geometry!r}")
        for name in ("rows", "padded_rows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"PoolLayout.{name} must be > 0, got {getattr(self, name)}")
        if not isinstance(self.data_offset, int) or self.data_offset < 0:
            raise ValueError(f"PoolLayout.data_offset must be >= 0, got {self.data_offset}")
        page = self.geometry.page_size
        if self.padded_rows < self.rows or self.padded_rows % page:
            raise ValueError(f"padded_rows {self.padded_rows} must be >= rows {self.rows} and a "
                             f"multiple of page_size {page}")

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def k_row_bytes(self) -> int:
        return self.geometry.k_row_elems * self.geometry.itemsize

    @property
    def v_row_bytes(self) -> int:
        return self.geometry.v_row_elems * self.geometry.itemsize

    @property
    def latent(self) -> bool:
        """One buffer per layer (no V rows): an MLA pool."""
        return self.geometry.latent

    @property
    def v_offset(self) -> int:
        """Bytes from a layer's start to its V rows."""
        return self.padded_rows * self.k_row_bytes

    @property
    def layer_stride(self) -> int:
        return self.padded_rows * (self.k_row_bytes + self.v_row_bytes)

    @property
    def data_bytes(self) -> int:
        return self.geometry.num_layers * self.layer_stride

    @property
    def num_pages(self) -> int:
        return self.padded_rows // self.geometry.page_size

    def chunk_bytes(self, half: int) -> int:
        """Bytes of one page of one layer's K (half 0) or V (half 1; 0 for a latent page)."""
        if half not in (K, V):
            raise ValueError(f"half must be K ({K}) or V ({V}), got {half!r}")
        return self.geometry.page_size * (self.k_row_bytes if half == K else self.v_row_bytes)

    def chunk_offset(self, page: int, layer: int, half: int) -> int:
        """Byte offset in the region of page `page`, layer `layer`, K (0) or V (1)."""
        if not (0 <= page < self.num_pages and 0 <= layer < self.geometry.num_layers
                and half in (K, V)):
            raise IndexError(f"page {page} / layer {layer} / half {half} outside {self}")
        return (self.data_offset + layer * self.layer_stride + half * self.v_offset
                + page * self.chunk_bytes(half))

    # ---- the wire ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The flat wire fields (`PoolLayoutMsg`'s names), plain values only; a latent page is
        one head of `latent_dim` with `v_head_dim` 0."""
        g = self.geometry
        return {"num_layers": g.num_layers, "rows": self.rows, "padded_rows": self.padded_rows,
                "head_num": g.num_kv_heads, "head_dim": g.head_dim, "v_head_dim": g.v_head_dim,
                "dtype": dtype_name(g.dtype), "page_size": g.page_size,
                "data_offset": self.data_offset}

    @classmethod
    def from_dict(cls, data) -> PoolLayout:
        """From the flat wire fields: a dict, or any object with them as attributes (the
        protocol's PoolLayoutMsg). ValueError names what is missing or wrong."""
        get = data.get if isinstance(data, dict) else (lambda k: getattr(data, k, None))
        values = {k: get(k) for k in WIRE_FIELDS}
        missing = [k for k, val in values.items() if val is None]
        extra = sorted(set(data) - set(WIRE_FIELDS)) if isinstance(data, dict) else []
        if missing or extra:
            raise ValueError(f"bad pool layout {data!r}: missing {missing}, unknown {extra}")
        try:
            geometry = KVGeometry(**{g: values[w] for w, g in _GEOMETRY_FIELDS.items()})
            return cls(geometry, values["rows"], values["padded_rows"], values["data_offset"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad pool layout {data!r}: {exc}") from None

    # ---- SGLang's buffers over a region ------------------------------------------------------
    def views(self, region: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """SGLang-shaped per-layer K and V tensors (rows x heads x dim) over `region` (uint8)."""
        if self.latent:
            raise ValueError("a latent pool has one buffer per layer: use latent_views")
        self._check_region(region)
        g = self.geometry
        ks, vs = [], []
        for layer in range(g.num_layers):
            base = self.data_offset + layer * self.layer_stride
            k = region[base: base + self.v_offset].view(g.dtype)
            v = region[base + self.v_offset: base + self.layer_stride].view(g.dtype)
            ks.append(k.view(self.padded_rows, g.num_kv_heads, g.head_dim)[: self.rows])
            vs.append(v.view(self.padded_rows, g.num_kv_heads, g.v_head_dim)[: self.rows])
        return ks, vs

    def latent_views(self, region: torch.Tensor) -> list[torch.Tensor]:
        """SGLang-shaped per-layer latent buffers (rows x 1 x latent_dim) over `region`."""
        if not self.latent:
            raise ValueError("a K/V pool has two buffers per layer: use views")
        self._check_region(region)
        g = self.geometry
        return [region[self.data_offset + layer * self.layer_stride:
                       self.data_offset + (layer + 1) * self.layer_stride]
                .view(g.dtype).view(self.padded_rows, 1, g.latent_dim)[: self.rows]
                for layer in range(g.num_layers)]

    def _check_region(self, region: torch.Tensor) -> None:
        if region.dtype != torch.uint8 or region.dim() != 1:
            raise ValueError("region must be a flat uint8 tensor")
        if region.numel() < self.data_offset + self.data_bytes:
            raise ValueError(f"region of {region.numel()} bytes is smaller than the pool's "
                             f"{self.data_offset + self.data_bytes}")
