"""Plain-torch references for the KV transfers: one obvious index_put per layer, no tricks.

Tests compare the Triton kernels and the fast CPU path against these.
"""

from __future__ import annotations

import torch

from .kv_layout import LayerShape, arena_layer_views


def _token_coords(slots: torch.Tensor, blocks: torch.Tensor, page_size: int):
    n = slots.shape[0]
    tok = torch.arange(n, device=slots.device)
    return blocks.long()[tok // page_size], tok % page_size


def store_layer_ref(arena, shape: LayerShape, layer, k, v, slots, blocks) -> None:
    """arena[block of token i, layer, K/V, row of token i] = k/v[slots[i]] for every token i."""
    blk, row = _token_coords(slots, blocks, shape.page_size)
    ak, av = arena_layer_views(arena, shape, layer)
    s = slots.long()
    ak[blk, row] = k[s].reshape(-1, shape.row_k)
    av[blk, row] = v[s].reshape(-1, shape.row_v)


def load_layer_ref(arena, shape: LayerShape, layer, k, v, slots, blocks) -> None:
    """k/v[slots[i]] = arena[block of token i, layer, K/V, row of token i] for every token i."""
    blk, row = _token_coords(slots, blocks, shape.page_size)
    ak, av = arena_layer_views(arena, shape, layer)
    s = slots.long()
    k[s] = ak[blk, row].reshape(-1, shape.num_kv_heads, shape.head_dim)
    v[s] = av[blk, row].reshape(-1, shape.num_kv_heads, shape.v_head_dim)
