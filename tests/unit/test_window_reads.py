"""SGLang's CPU attention backend on a hybrid sliding-window pool, with the window-reads
stand-in (`sglang_swift/cpu_compat/window_reads.py`): a window layer's rows are written at the
tokens' window-pool slots, so they must be read there. The backend (SGLang's own
`TorchNativeAttnBackend`, `SWAKVPool` and `SWATokenToKVPoolAllocator`) runs one prefill whose
full-pool slots are 5 ids ahead of its window-pool slots, as a donor that lent 5 full-attention
pages has them; its output must equal plain causal attention over the same queries, keys and
values. SGLang's unpatched method (the stand-in's `__wrapped__`) reads other slots there: the
negative control that shows the check can fail.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

HEADS, DIM, TOKENS, AHEAD = 2, 8, 6, 5


def _prefill(forward_extend):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(size=32, size_swa=16, page_size=1, dtype=torch.float32, head_num=HEADS,
                     head_dim=DIM, swa_attention_layer_ids=[1], full_attention_layer_ids=[0],
                     device="cpu", enable_memory_saver=False)
    allocator = SWATokenToKVPoolAllocator(32, 16, 1, torch.float32, "cpu", pool,
                                          need_sort=False)
    allocator.full_attn_allocator.alloc(AHEAD)  # full-attention pages out (lent)
    loc = allocator.alloc(TOKENS)
    assert torch.equal(pool.translate_loc_from_full_to_swa(loc), loc - AHEAD)
    req_to_token = torch.zeros(2, 16, dtype=torch.int32)
    req_to_token[1, :TOKENS] = loc.to(torch.int32)
    backend = TorchNativeAttnBackend(NS(device="cpu", req_to_token_pool=NS(
        req_to_token=req_to_token), token_to_kv_pool=pool))
    batch = NS(out_cache_loc=loc, req_pool_indices=torch.tensor([1]),
               seq_lens=torch.tensor([TOKENS]), extend_prefix_lens=torch.tensor([0]),
               extend_seq_lens=torch.tensor([TOKENS]), encoder_lens=None)
    backend.init_forward_metadata(batch)
    layer = NS(layer_id=1, tp_q_head_num=HEADS, tp_k_head_num=HEADS, qk_head_dim=DIM,
               v_head_dim=DIM, is_cross_attention=False, attn_type=AttentionType.DECODER,
               scaling=DIM ** -0.5, sliding_window_size=64, k_scale=None, v_scale=None)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(TOKENS, HEADS * DIM, generator=gen) for _ in range(3))
    pool.swa_kv_pool.k_buffer[0].normal_(generator=gen)  # other tokens' rows everywhere else
    pool.swa_kv_pool.v_buffer[0].normal_(generator=gen)
    rows = (k.view(TOKENS, HEADS, DIM), v.view(TOKENS, HEADS, DIM))  # as RadixAttention passes
    out = forward_extend(backend, q, *rows, layer, batch).view(TOKENS, HEADS, DIM)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.view(TOKENS, HEADS, DIM).transpose(0, 1) for t in (q, k, v)),
        is_causal=True, scale=DIM ** -0.5).transpose(0, 1)
    return out, want


def test_a_window_layer_reads_its_rows_at_their_window_slots():
    """Invariant: with the stand-in, a window layer's prefill attends to the rows it wrote, where
    the full-attention and window free lists handed out different ids."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sglang_swift.cpu_compat import hicache

    forward_extend = TorchNativeAttnBackend.forward_extend
    if getattr(forward_extend, hicache.MARK, None) is None:
        pytest.fail("the window-reads stand-in is not installed on the CPU engine")
    out, want = _prefill(forward_extend)
    assert torch.allclose(out, want, atol=1e-5)
    unpatched, want = _prefill(forward_extend.__wrapped__)  # SGLang's own method
    assert not torch.allclose(unpatched, want, atol=1e-2)
