"""The layer-streamed load part of scripts/gpu_check.py (imported by it; not run on its own).

Times what a borrower's prefill does with a donor hit (docs/streaming.md): the prefix's KV is
loaded from donor pool pages into the borrower's pool layer by layer by the pool-lease engine on
its side stream, signalling a CUDA layer counter, while a consumer runs attention per layer and
waits (GPU-side) only for the layer it is about to read, as SGLang's pool getters do. The same
attention with everything resident is the baseline; the ratio (streamed / resident, target at
most 1.10) says how much of the copy the attention did not hide. The loaded KV is checked
bit-identical. In the CPU dry run the same code runs with a CPU lane and counter.
"""

from __future__ import annotations

STREAM_TOKENS_MAX = 16384  # prefix length: a long prompt's worth of KV per layer
NEW_TOKENS = 512  # the prefill chunk that attends over the prefix
GQA = 4  # query heads per KV head, as in Qwen3 / Llama 3
TARGET = 1.10


def _attention(q, k_buf, v_buf, slots):
    """One layer's prefill attention over the prefix slots (gathered as the backends do)."""
    import torch

    k = k_buf.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    v = v_buf.index_select(0, slots).transpose(0, 1).unsqueeze(0)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def run_stream_check(args, device, timer) -> dict:
    """`timer(fn, repeats, device)` -> seconds per call (gpu_check's CUDA-event timer)."""
    import torch

    from sglang_swift.dataplane import (
        CpuLayerCounter,
        CudaLayerCounter,
        KVGeometry,
        LeasePacking,
        PoolLayout,
        PoolTransferEngine,
    )

    g = KVGeometry(args.layers, args.kv_heads, args.head_dim, args.head_dim, args.dtype,
                   args.page_sizes[-1])
    tokens = min(args.tokens, STREAM_TOKENS_MAX if device.type == "cuda" else 2048)
    blocks = -(-tokens // g.page_size)
    tokens = blocks * g.page_size
    pages = blocks + 4
    layout = PoolLayout(g, pages * g.page_size, pages * g.page_size)  # donor of the same shape
    region = torch.empty(layout.data_bytes, dtype=torch.uint8, device=device)
    packing = LeasePacking(g, layout, list(range(pages - 1, -1, -1)))  # reversed: scattered
    rows = 2 * tokens + 64
    dtype = getattr(torch, args.dtype)
    k_buf = [torch.randn(rows, g.num_kv_heads, g.head_dim, device=device).to(dtype)
             for _ in range(g.num_layers)]
    v_buf = [torch.randn(rows, g.num_kv_heads, g.head_dim, device=device).to(dtype)
             for _ in range(g.num_layers)]
    engine = PoolTransferEngine(packing, region, k_buf, v_buf)
    src = torch.arange(0, tokens, device="cpu")
    dst = torch.arange(tokens + 64, 2 * tokens + 64, device="cpu")
    block_ids = list(range(blocks))
    assert engine.begin_store(src, block_ids).wait(60).ok, "the prefix could not be stored"
    dst_dev = dst.to(device)
    q = torch.randn(1, g.num_kv_heads * GQA, NEW_TOKENS, g.head_dim, device=device).to(dtype)
    counter_cls = CudaLayerCounter if device.type == "cuda" else CpuLayerCounter
    counter = counter_cls(g.num_layers, timeout_s=60)

    def resident():
        for layer in range(g.num_layers):
            _attention(q, k_buf[layer], v_buf[layer], dst_dev)

    def streamed():
        handle = engine.begin_load(dst, block_ids, counter)
        counter.set_consumer(handle.producer_id)
        for layer in range(g.num_layers):
            counter.wait_until(layer)
            _attention(q, k_buf[layer], v_buf[layer], dst_dev)
        counter.set_consumer(-1)
        return handle

    for buf in k_buf + v_buf:  # poison the destination: the check below must see the load
        buf[tokens + 64:].view(torch.uint8).fill_(0xA5)
    handle = streamed()
    ok = handle.wait(60).ok and all(
        torch.equal(b.index_select(0, src.to(device)).view(torch.uint8),
                    b.index_select(0, dst_dev).view(torch.uint8)) for b in k_buf + v_buf)
    repeats = max(3, args.repeats // 2)
    t_res = timer(resident, repeats, device)
    handles = []  # waited after timing: a host wait inside the timed region would skew it
    t_str = timer(lambda: handles.append(streamed()), repeats, device)
    ok = all(h.wait(60).ok for h in handles) and ok
    engine.close()
    return {"ok": bool(ok), "tokens": tokens, "new_tokens": NEW_TOKENS,
            "kv_mib_per_layer": round(tokens * g.bytes_per_token_per_layer / 2**20, 1),
            "resident_ms": round(t_res * 1e3, 3), "streamed_ms": round(t_str * 1e3, 3),
            "ratio": round(t_str / t_res, 3), "target": TARGET, "backend": engine.backend}
