"""Plain-torch references for the KV transfers: one obvious index_put per layer, no tricks.

Tests compare the Triton kernels and the fast CPU path against these.
"""

from __future__ import annotations

import torch

from .geometry import KVGeometry
from .kv_layout import arena_layer_views


def _token_coords(slots: torch.Tensor, blocks: torch.Tensor, page_size: int):
    n = slots.shape[0]
    tok = torch.arange(n, device=slots.device)
    return blocks.long()[tok // page_size], tok % page_size


def store_layer_ref(arena, geometry: KVGeometry, layer, k, v, slots, blocks) -> None:
    """arena[block of token i, layer, K/V, row of token i] = k/v[slots[i]] for every token i."""
    blk, row = _token_coords(slots, blocks, geometry.page_size)
    ak, av = arena_layer_views(arena, geometry, layer)
    s = slots.long()
    ak[blk, row] = k[s].reshape(-1, geometry.k_row_elems)
    av[blk, row] = v[s].reshape(-1, geometry.v_row_elems)


def load_layer_ref(arena, geometry: KVGeometry, layer, k, v, slots, blocks) -> None:
    """k/v[slots[i]] = arena[block of token i, layer, K/V, row of token i] for every token i."""
    blk, row = _token_coords(slots, blocks, geometry.page_size)
    ak, av = arena_layer_views(arena, geometry, layer)
    s = slots.long()
    k[s] = ak[blk, row].reshape(-1, geometry.num_kv_heads, geometry.head_dim)
    v[s] = av[blk, row].reshape(-1, geometry.num_kv_heads, geometry.v_head_dim)
