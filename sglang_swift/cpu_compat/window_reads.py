"""Sliding-window layers read at their own pool's slots in SGLang's CPU attention backend.

SGLang 0.5.23 keeps a hybrid sliding-window model's KV in `SWAKVPool`: the full-attention layers'
rows at full-pool slots, the window layers' rows at window-pool slots, one free list each
(`SWATokenToKVPoolAllocator`), a token's window slot found through `full_to_swa_index_mapping`.
Its CPU backend (`TorchNativeAttnBackend`) writes a window layer's rows at the translated slots
but reads them at the request's full-pool slots (`req_to_token`), untranslated. That is right
only while both free lists have handed out the same ids, as they do on a fresh server; once they
part (a donor lending pages of its full-attention pool does that at once), a window layer reads
other tokens' rows and the model answers nonsense. Measured here with `tiny-swa`: a server whose
full-attention list started 3584 ids ahead answered "UN" for every token where a fresh one
answers as the model does.

The stand-in wraps `forward_extend` and `forward_decode`: for a window layer it hands the
backend a view of the request table that translates each slot it reads into the window pool
(`TranslatedRows`); full-attention layers and every other backend are untouched. Slots outside
the window (released, translated to the padding slot 0) are masked by the backend's window mask
as before. Installed through `hicache.PATCHES` (the CPU engine's patch list) on the CPU engine
only; a GPU install uses SGLang's own backends.
"""

from __future__ import annotations

from typing import Any


class TranslatedRows:
    """A request-to-token table read through `mapping`: `rows[i, a:b]` is
    `mapping[table[i, a:b]]`, the window-pool slots of those tokens. Only indexing is offered:
    the backend reads one request's run of slots at a time."""

    def __init__(self, table: Any, mapping: Any) -> None:
        self.table = table
        self.mapping = mapping

    def __getitem__(self, key: Any) -> Any:
        return self.mapping[self.table[key].long()]


class _WindowTable:
    """The backend's `req_to_token_pool` for one window layer's call."""

    def __init__(self, pool: Any, mapping: Any) -> None:
        self.req_to_token = TranslatedRows(pool.req_to_token, mapping)


def _window_mapping(backend: Any, layer: Any) -> Any:
    """The full-to-window slot mapping when `layer` is a window layer of an SWA pool, else
    None."""
    pool = backend.token_to_kv_pool
    if not getattr(backend, "use_sliding_window_kv_pool", False):
        return None
    _, is_window = pool.layers_mapping[layer.layer_id]
    return pool.full_to_swa_index_mapping if is_window else None


def window_reads(original: Any) -> Any:
    """`forward_extend` / `forward_decode` of `TorchNativeAttnBackend`, reading a window layer's
    rows at its window-pool slots."""

    def forward(self, q, k, v, layer, forward_batch, *args, **kwargs):
        mapping = _window_mapping(self, layer)
        if mapping is None:
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
        table = self.req_to_token_pool
        self.req_to_token_pool = _WindowTable(table, mapping)
        try:
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            self.req_to_token_pool = table

    forward.__wrapped__ = original
    forward.__name__ = original.__name__
    return forward
