"""KV geometry of one model and how many arena bytes one page of it takes.

A block of the arena holds one page of tokens of one model's KV for all its layers
(block-major). Inside a block the layout is, for each layer l in order:

    K[l]: [page_size, num_kv_heads, head_dim]     then
    V[l]: [page_size, num_kv_heads, v_head_dim]

so layer l of a block starts at `l * layer_bytes` and a page's K rows of one layer are one
contiguous run (what a per-layer load reads). Bytes after `num_layers * layer_bytes` are unused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Every block starts on this boundary, so any dtype view of the arena is aligned and Triton /
# CUDA copies can use 16-byte vector accesses on every row.
BLOCK_ALIGN_BYTES = 512

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"` -> torch.bfloat16 (also accepts a torch.dtype)."""
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one model's (one TP rank's) KV cache as SGLang's MHATokenToKVPool holds it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    page_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_from_name(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "v_head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVGeometry.{name} must be a positive int, got {value!r}")

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def k_row_elems(self) -> int:
        """Elements of K for one token of one layer (heads x head_dim)."""
        return self.num_kv_heads * self.head_dim

    @property
    def v_row_elems(self) -> int:
        return self.num_kv_heads * self.v_head_dim

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K plus V bytes of one token in one layer (4096 for Llama-3-8B / Qwen3-8B in bf16)."""
        return (self.k_row_elems + self.v_row_elems) * self.itemsize

    @property
    def layer_elems(self) -> int:
        """Elements one layer of one page takes inside a block (K page then V page)."""
        return self.page_size * (self.k_row_elems + self.v_row_elems)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page for all layers: the least a block must hold."""
        return self.num_layers * self.layer_elems * self.itemsize

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "v_head_dim": self.v_head_dim,
            "dtype": dtype_name(self.dtype),
            "page_size": self.page_size,
        }

    @classmethod
    def from_dict(cls, d: dict) -> KVGeometry:
        return cls(**{**d, "dtype": dtype_from_name(d["dtype"])})


def _round_up(x: int, align: int) -> int:
    return (x + align - 1) // align * align


def block_bytes_for(geometry: KVGeometry, align: int = BLOCK_ALIGN_BYTES) -> int:
    """Bytes a block needs to hold one page of `geometry`, rounded up to `align`."""
    return _round_up(geometry.page_bytes, align)


def choose_block_bytes(geometries: list[KVGeometry], align: int = BLOCK_ALIGN_BYTES) -> int:
    """Block size of an arena that must serve every geometry in `geometries`.

    One block size per arena keeps ownership moves O(1) (any free block fits any borrower);
    the price is that a model whose page is smaller than the largest leaves the difference
    unused in every block it holds (see `unused_bytes`).
    """
    if not geometries:
        raise ValueError("choose_block_bytes needs at least one KVGeometry")
    return max(block_bytes_for(g, align) for g in geometries)


def unused_bytes(geometry: KVGeometry, block_bytes: int) -> int:
    """Bytes of each block that `geometry` leaves unused; raises if its page does not fit."""
    if geometry.page_bytes > block_bytes:
        raise ValueError(
            f"a page of {geometry} takes {geometry.page_bytes} bytes, more than the arena's "
            f"block of {block_bytes}; lower page_size for this model or build the arena with "
            f"choose_block_bytes() over every model that will borrow from it"
        )
    return block_bytes - geometry.page_bytes


def fit_page_size(geometry: KVGeometry, block_bytes: int, multiple_of: int = 1) -> KVGeometry:
    """The same model with the largest page (tokens per block) that fits `block_bytes`, a
    multiple of `multiple_of` (the server's own page size). A model smaller than the one the
    arena was sized for fills its blocks with more tokens instead of leaving bytes unused."""
    per_token = geometry.num_layers * geometry.bytes_per_token_per_layer
    page = block_bytes // per_token // multiple_of * multiple_of
    if page <= 0:
        raise ValueError(
            f"one token of {geometry} for all layers takes {per_token} bytes; a "
            f"block of {block_bytes} cannot hold {multiple_of} of them"
        )
    return KVGeometry(
        geometry.num_layers,
        geometry.num_kv_heads,
        geometry.head_dim,
        geometry.v_head_dim,
        geometry.dtype,
        page,
    )
