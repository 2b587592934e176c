"""KVGeometry: the one description of a model's KV page, used by the kernels, the data plane and
the runtime.

It describes any model's page (one TP rank): layers, KV heads, head dim, V head dim, dtype and
tokens per page. Local KV (SGLang's MHATokenToKVPool) keeps per layer one K tensor
`[rows, num_kv_heads, head_dim]` and one V tensor `[rows, num_kv_heads, v_head_dim]`, indexed by
token slot. An MLA pool (SGLang's MLATokenToKVPool) keeps one latent buffer per layer,
`[rows, 1, kv_lora_rank + qk_rope_head_dim]`: a **latent** page, one head of that width as its K
rows and no V rows (`v_head_dim` 0, `KVGeometry.latent`). A page's image in the byte stream of a
pool lease is layer-major; for each layer l:

    K[l]: [page_size, num_kv_heads, head_dim]     then
    V[l]: [page_size, num_kv_heads, v_head_dim]   (nothing for a latent page)

so (layer l, K or V) of a page is one contiguous byte run, `span(l, kv)`, and a page takes
`page_bytes`; where those bytes land in a donor's pool is `LeasePacking`
(sglang_swift/dataplane/packing.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

K, V = 0, 1  # which half of a layer a span names (K rows come first)

# The KV storage dtypes a page may hold (SGLang stores fp8 KV as uint8 or as an fp8 dtype).
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn,
              torch.float8_e5m2, torch.uint8)
}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"` (or torch.bfloat16) -> torch.bfloat16; ValueError for an unsupported dtype."""
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: str | torch.dtype) -> str:
    """torch.bfloat16 -> `"bfloat16"`; ValueError for an unsupported dtype."""
    return str(dtype_from_name(dtype)).removeprefix("torch.")


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one model's (one TP rank's) KV cache as SGLang's MHATokenToKVPool holds it (or
    its MLATokenToKVPool: `v_head_dim` 0, see `latent`), and the byte layout of one page of it.
    Immutable; `dtype` may be given by name."""

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
            least, what = (0, "an int >= 0") if name == "v_head_dim" else (1, "a positive int")
            if not isinstance(value, int) or value < least:
                raise ValueError(f"KVGeometry.{name} must be {what}, got {value!r}")
        if self.v_head_dim == 0 and self.num_kv_heads != 1:
            raise ValueError(f"a latent page (v_head_dim 0: one buffer per layer) has one head, "
                             f"got num_kv_heads {self.num_kv_heads}")

    @classmethod
    def latent_page(cls, num_layers: int, latent_dim: int, dtype: str | torch.dtype,
                    page_size: int) -> KVGeometry:
        """The page of a pool keeping one `[rows, 1, latent_dim]` buffer per layer (SGLang's
        MLATokenToKVPool: latent_dim = kv_lora_rank + qk_rope_head_dim)."""
        return cls(num_layers, 1, latent_dim, 0, dtype, page_size)

    @property
    def latent(self) -> bool:
        """One buffer per layer, K rows only (an MLA pool's latent rows)."""
        return self.v_head_dim == 0

    @property
    def latent_dim(self) -> int:
        if not self.latent:
            raise ValueError(f"{self} keeps K and V rows, not one latent row")
        return self.head_dim

    @property
    def halves(self) -> tuple[int, ...]:
        """The buffers a layer has: (K, V), or (K,) for a latent page."""
        return (K,) if self.latent else (K, V)

    # ---- one token ---------------------------------------------------------------------------
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
    def bytes_per_token(self) -> int:
        """K plus V bytes of one token over all layers (256 KiB for Qwen3-32B in bf16)."""
        return self.num_layers * self.bytes_per_token_per_layer

    # ---- one page ----------------------------------------------------------------------------
    @property
    def layer_elems(self) -> int:
        """Elements one layer of one page takes (K page then V page)."""
        return self.page_size * (self.k_row_elems + self.v_row_elems)

    @property
    def layer_bytes(self) -> int:
        return self.layer_elems * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page for all layers: the least a block must hold."""
        return self.num_layers * self.layer_bytes

    def elem_span(self, layer: int, kv: str) -> tuple[int, int]:
        """(first element, element count) of layer `layer`'s K or V rows within a page, counted
        in `dtype` elements; K and V of a layer are back to back (V: no elements on a latent
        page)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside this geometry's {self.num_layers} layers")
        k_elems = self.page_size * self.k_row_elems
        start = layer * self.layer_elems
        if kv == K:
            return start, k_elems
        if kv == V:
            return start + k_elems, self.page_size * self.v_row_elems
        raise ValueError(f"kv must be K ({K}) or V ({V}), got {kv!r}")

    def span(self, layer: int, kv: str) -> tuple[int, int]:
        """(byte offset, byte count) of layer `layer`'s K or V rows within one page's image."""
        start, count = self.elem_span(layer, kv)
        return start * self.itemsize, count * self.itemsize

    # ---- the wire ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_dict(cls, d: dict) -> KVGeometry:
        return cls(**{**d, "dtype": dtype_from_name(d["dtype"])})
