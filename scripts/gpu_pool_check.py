"""The pool-lease part of scripts/gpu_check.py (imported by it; not run on its own), once per
page size of the run.

The donor process places a pool of its own shape in one exportable region (`SharedArena`, as
the plugin places a lending server's SGLang pool), fills it, and lends some pages; the borrower
process, of another
shape (fewer layers in the donor, a donor page half the borrower's, so pieces straddle chunks
and pages), maps it from the descriptor plus layout (CUDA IPC on a GPU, shm in the CPU dry run)
and checks, with the engine the runtime uses:
- pool_ipc_roundtrip: store, then layer-wise load into poisoned slots (Triton within one GPU,
  CUDA layer counter events): bit-identical;
- pool_stream_matches_rule: the donor's pages, read in grant order chunk by chunk, hold exactly
  the borrower blocks the packing rule puts there;
- pool_backends_agree: the one-pass Triton copy and the gather-copy-scatter path load the same;
- pool_exchange: a donor hit swapped with device victims in place (`begin_exchange`), then
  swapped back: each side holds the other's bytes, then its own again;
- pool_cross_device (two GPUs only, else skipped with a message): the borrower's pool on
  another GPU than the donor's, store and load through the cross-device path;
and the donor checks (pool_donor_sees_bytes) that its own buffers hold the borrower's stream.
"""

from __future__ import annotations

POOL_TOKENS_MAX = 16384  # the pool check's prefix: enough to measure, small enough to verify
CHECKSUM_CHUNK = 64 << 20  # bytes weighted at a time (int64 temporaries, 8x the chunk)


def pool_geometries(args, page: int):
    """(donor page, borrower page): the borrower is the run's model with `page` tokens per
    page; the donor has 4 more layers and half the page size (a borrower page larger than the
    donor's)."""
    from sglang_swift.dataplane import KVGeometry

    borrower = KVGeometry(args.layers, args.kv_heads, args.head_dim, args.head_dim, args.dtype,
                          page)
    donor = KVGeometry(args.layers + 4, args.kv_heads, args.head_dim, args.head_dim, args.dtype,
                       max(1, page // 2))
    return donor, borrower


def make_donor_pool(args, device, page: int):
    """Donor side, for a borrower page of `page` tokens: (region, layout, own k/v views, lent
    pages, message for the borrower)."""
    import torch

    from sglang_swift.dataplane import BLOCK_ALIGN_BYTES, LeasePacking, PoolLayout, SharedArena

    donor, borrower = pool_geometries(args, page)
    tokens = min(args.tokens, POOL_TOKENS_MAX)
    blocks = -(-tokens // borrower.page_size)
    need = LeasePacking.pages_for(borrower, PoolLayout(donor, donor.page_size, donor.page_size),
                                  blocks)
    pages_total = 2 * need + 4
    rows = pages_total * donor.page_size
    layout = PoolLayout(donor, rows, rows)
    arena = SharedArena(1, -(-layout.data_bytes // BLOCK_ALIGN_BYTES) * BLOCK_ALIGN_BYTES,
                        device=str(device))
    k, v = layout.views(arena.memory.view(-1))
    for buf in k + v:  # the donor's own KV
        buf.view(torch.uint8).random_()
    pages = list(range(pages_total - 1, pages_total - 1 - 2 * need, -2))  # every other, reversed
    desc = arena.export()
    msg = {"desc": {**desc, "handle": desc["handle"].hex(), "layout": layout.to_dict()},
           "pages": pages, "page": page}
    return arena, layout, (k, v), pages, msg


def stream_checksum(k_bufs, v_bufs, page_size, pages, used: int) -> int:
    """Position-weighted checksum of the first `used` stream bytes, read through SGLang-shaped
    buffers (for each page in grant order, each layer's K rows then V rows)."""
    import torch

    stream = torch.cat([buf[p * page_size:(p + 1) * page_size].reshape(-1).view(torch.uint8)
                        for p in pages for k, v in zip(k_bufs, v_bufs) for buf in (k, v)])
    return _weighted(stream[:used])


def _weighted(raw) -> int:
    """sum(byte[i] x (i % 251 + 1)), a chunk at a time (the int64 temporaries stay small)."""
    import torch

    total = 0
    for start in range(0, raw.numel(), CHECKSUM_CHUNK):
        x = raw[start:start + CHECKSUM_CHUNK].to(torch.int64)
        weights = torch.arange(start, start + x.numel(), device=x.device) % 251 + 1
        total += int((x * weights).sum())
    return total


def borrower_pool_checks(args, msg, device, local_pool, timer, dry_run: bool):
    """Borrower side: (checks, row, info). `local_pool(g, slots, device, seed)` and
    `timer(fn, repeats, device)` are gpu_check's helpers."""
    import torch

    from sglang_swift.dataplane import (
        LeasePacking,
        PoolTransferEngine,
        make_layer_counter,
        map_pool,
    )

    _, g = pool_geometries(args, msg["page"])
    mapped = map_pool({**msg["desc"], "handle": bytes.fromhex(msg["desc"]["handle"])})
    packing = LeasePacking(g, mapped.layout, msg["pages"])
    P, nblocks = g.page_size, packing.num_blocks
    num_slots = 2 * nblocks * P
    k, v = local_pool(g, num_slots, device, seed=11)
    perm = torch.randperm(num_slots // P)
    ar = torch.arange(P)
    slots = (perm[:nblocks, None] * P + ar).reshape(-1)
    dst = (perm[nblocks:, None] * P + ar).reshape(-1)
    blocks = torch.randperm(nblocks)
    backend = "triton" if dry_run else "auto"  # the dry run interprets the kernel
    eng = PoolTransferEngine(packing, mapped.region, k, v, liveness=mapped.alive,
                             backend=backend)
    checks, info = {}, {"backend": eng.backend, "blocks": nblocks, "unit": packing.unit}
    assert eng.begin_store(slots, blocks).wait(120).ok

    def load_into(backend_name, local_device=device):
        k2 = [torch.full(x.shape, float("nan"), dtype=x.dtype, device=local_device) for x in k]
        v2 = [torch.full(x.shape, float("nan"), dtype=x.dtype, device=local_device) for x in v]
        loader = PoolTransferEngine(packing, mapped.region, k2, v2, liveness=mapped.alive,
                                    backend=backend_name)
        counter = make_layer_counter(g.num_layers, local_device, timeout_s=60)
        h = loader.begin_load(dst, blocks, counter)
        counter.set_consumer(h.producer_id)
        ok = all(counter.wait_until(layer) for layer in range(g.num_layers))
        ok = ok and h.wait(120).ok
        loader.close()
        return ok, k2, v2

    def same(bufs_a, bufs_b, idx_a, idx_b):  # bitwise, on a's device
        return all(torch.equal(a[idx_a.to(a.device)].view(torch.int8),
                               b[idx_b.to(b.device)].to(a.device).view(torch.int8))
                   for a, b in zip(bufs_a, bufs_b))

    ok, k2, v2 = load_into(backend)
    checks["pool_ipc_roundtrip"] = bool(ok and same(k2, k, dst, slots) and same(v2, v, dst, slots))
    ok_r, k3, v3 = load_into("reference")
    checks["pool_backends_agree"] = bool(ok_r and same(k3, k2, dst, dst) and same(v3, v2, dst,
                                                                                  dst))
    order = blocks.argsort().tolist()
    expected = torch.cat([buf[layer][slots[q * P:(q + 1) * P].to(device)].reshape(-1)
                          .view(torch.uint8) for q in order for layer in range(g.num_layers)
                          for buf in (k, v)])
    dk, dv = mapped.layout.views(mapped.region)
    info["used"] = expected.numel()
    info["checksum"] = _weighted(expected)
    seen = stream_checksum(dk, dv, mapped.layout.geometry.page_size, msg["pages"], info["used"])
    checks["pool_stream_matches_rule"] = seen == info["checksum"]
    del dk, dv, k3, v3
    checks["pool_exchange"] = _exchange_twice(eng, k, v, slots, dst, blocks, device, same)
    _cross_device(checks, info, device, dry_run, load_into, same, k, v, slots, dst)
    row = _bandwidth(args, eng, packing, k, slots, dst, blocks, device, timer)
    eng.close()
    mapped.close()
    return checks, row, info


def _exchange_twice(eng, k, v, slots, dst, blocks, device, same) -> bool:
    """A donor hit swapped with device victims (`begin_exchange`, enqueued on the lane): the
    victims' slots `dst` then hold the stored prefix (slots `slots`), and a second exchange puts
    the victims back and the prefix into the blocks again (so the donor's own check still sees
    the stream it expects)."""
    import torch

    before_k = [x[dst.to(x.device)].clone() for x in k]
    before_v = [x[dst.to(x.device)].clone() for x in v]
    ok = eng.begin_exchange(dst, blocks).wait(120).ok
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    ok = ok and same(k, k, dst, slots) and same(v, v, dst, slots)
    ok = eng.begin_exchange(dst, blocks).wait(120).ok and ok
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    back = all(torch.equal(x[dst.to(x.device)].view(torch.int8), b.view(torch.int8))
               for x, b in zip((*k, *v), (*before_k, *before_v)))
    return bool(ok and back)


def _cross_device(checks, info, device, dry_run, load_into, same, k, v, slots, dst):
    import torch

    if dry_run:  # CPU: the same code path with both devices "cpu"
        other = torch.device("cpu")
    elif torch.cuda.device_count() >= 2:
        other = torch.device(f"cuda:{((device.index or 0) + 1) % torch.cuda.device_count()}")
    else:
        info["cross_device"] = (f"skipped: {torch.cuda.device_count()} GPU visible; the "
                                f"cross-device path needs two")
        return
    ok, k4, v4 = load_into("reference", other)
    checks["pool_cross_device"] = bool(ok and same(k4, k, dst, slots) and same(v4, v, dst, slots))
    info["cross_device"] = f"borrower pool on {other}, donor pool on {device}"


def _bandwidth(args, eng, packing, k, slots, dst, blocks, device, timer) -> dict:
    import torch

    from sglang_swift.dataplane import make_layer_counter

    g = packing.borrower
    nbytes = slots.numel() * g.bytes_per_token
    src_c = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst_c = torch.empty_like(src_c)
    counter = make_layer_counter(g.num_layers, device, timeout_s=60)

    def load():
        h = eng.begin_load(dst, blocks, counter)
        counter.set_consumer(h.producer_id)
        for layer in range(g.num_layers):
            counter.wait_until(layer)
        h.wait(120)

    t_copy = timer(lambda: dst_c.copy_(src_c), args.repeats, device)
    t_store = timer(lambda: eng.begin_store(slots, blocks).wait(120), args.repeats, device)
    t_load = timer(load, args.repeats, device)
    return {"page_size": g.page_size, "donor_page_size": packing.donor.geometry.page_size,
            "donor_layers": packing.donor.geometry.num_layers, "bytes": nbytes,
            "copy_gbps": nbytes / t_copy / 1e9, "store_gbps": nbytes / t_store / 1e9,
            "load_gbps": nbytes / t_load / 1e9,
            "load_ms_per_layer": t_load / g.num_layers * 1e3, "unit": packing.unit,
            "backend": eng.backend}
