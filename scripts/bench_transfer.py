#!/usr/bin/env python3
"""Bandwidth of the KV data plane on this machine: store (local pool -> donor pages, all layers)
and layer-wise load (donor pages -> local slots, one layer at a time, signalling the layer
counter), against a plain contiguous copy of the same number of bytes in the same run.

It measures the pool-lease path on CPU, as a server runs it: the borrower's pages packed into
pages of a donor's own pool in POSIX shared memory (`--donor-layers`, default the borrower's;
same heads and dims; `--donor-page-size`) through `PoolTransferEngine` (unit gather and scatter
through a staging buffer) on the copy worker thread. Triton-interpreted timings mean nothing and
are not measured; GPU numbers come from scripts/gpu_check.py. The last line printed is a JSON
object with store_ratio and load_ratio (the worst page size's ratio to the contiguous copy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from sglang_swift.control.ledger import DonorLedger
from sglang_swift.dataplane import (
    BLOCK_ALIGN_BYTES,
    CpuLayerCounter,
    KVGeometry,
    LeasePacking,
    PoolLayout,
    PoolTransferEngine,
    SharedArena,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, finishes in under 30 s")
    p.add_argument(
        "--tokens", type=int, default=None, help="prefix length (default 8192; quick 4096)"
    )
    p.add_argument("--page-sizes", default=None, help="default 16,32,64; quick 16,64")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5; quick 3)")
    p.add_argument("--donor-layers", type=int, default=None,
                   help="layers of the donor's pool (default: the borrower's)")
    p.add_argument("--donor-page-size", type=int, default=None,
                   help="the donor pool's page size (default: the borrower's)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the copy lane (the baseline copy runs on the same lane)",
    )
    return p.parse_args(argv)


QUICK_BUDGET_S = 18.0  # seconds of timed rounds under --quick, all page sizes together


def _pattern(*shape, dtype, seed: int) -> torch.Tensor:
    """Distinct 16-bit words per element (cheap for hundreds of MiB, unlike randn); the values
    only have to differ between slots so the round trip can be verified."""
    t = torch.empty(*shape, dtype=dtype)
    words = t.view(torch.int16).view(-1)
    words.copy_((torch.arange(words.numel(), dtype=torch.int32) * 7 + seed).to(torch.int16))
    return t


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Pool:
    """One local pool and one baseline buffer pair, shared by every page size of the run.

    Every slot's row differs from every other's (one pattern), and each layer's tensor differs
    in its first word per slot, so a round trip that mixed slots or layers would not verify."""

    def __init__(self, g: KVGeometry, num_slots: int, nbytes: int):
        base_k = _pattern(num_slots, g.num_kv_heads, g.head_dim, dtype=g.dtype, seed=1)
        base_v = _pattern(num_slots, g.num_kv_heads, g.v_head_dim, dtype=g.dtype, seed=2)
        self.k, self.v = [], []
        for layer in range(g.num_layers):
            for base, out in ((base_k, self.k), (base_v, self.v)):
                t = base.clone()
                t.view(torch.int16)[:, 0, 0] = layer
                out.append(t)
        self.src_c = torch.full((nbytes,), 0x5A, dtype=torch.uint8)  # a copy ignores content
        self.dst_c = torch.zeros_like(self.src_c)


def _pool_target(g: KVGeometry, npages: int, threads: int, k, v, donor: KVGeometry):
    """A donor's own pool in shared memory, lent page by page (ledger order), the borrower's
    pages packed into it: (lane, store(slots), load(dst, counter), close)."""
    need = LeasePacking.pages_for(g, PoolLayout(donor, donor.page_size, donor.page_size), npages)
    rows = (need + 8) * donor.page_size
    layout = PoolLayout(donor, rows, rows)
    arena = SharedArena(-(-layout.data_bytes // BLOCK_ALIGN_BYTES) * BLOCK_ALIGN_BYTES)
    book = DonorLedger()
    book.offer(range(layout.num_pages))
    pages = sorted(book.grant("bench", 1, need, 0).active)
    eng = PoolTransferEngine(LeasePacking(g, layout, pages), arena.memory.view(-1), k, v,
                             cpu_threads=threads)
    blocks = list(range(npages))
    return (eng.lane, lambda slots: eng.begin_store(slots, blocks),
            lambda dst, counter: eng.begin_load(dst, blocks, counter),
            lambda: (eng.close(), arena.close()))


def bench_page_size(
    g: KVGeometry, tokens: int, repeats: int, threads: int, pool: Pool, deadline: float,
    donor: KVGeometry | None = None,
) -> dict:
    """One page size's round: `donor` is the donor pool's geometry (default: `g`'s)."""
    donor = donor or g
    npages = -(-tokens // g.page_size)
    k, v, src_c, dst_c = pool.k, pool.v, pool.src_c, pool.dst_c
    num_slots = k[0].shape[0]  # at least twice the prefix: its pages are scattered in the pool
    gen = torch.Generator().manual_seed(g.page_size)
    perm = torch.randperm(num_slots // g.page_size, generator=gen)
    slots = (perm[:npages, None] * g.page_size + torch.arange(g.page_size)).reshape(-1)[:tokens]
    dst = (perm[npages : 2 * npages, None] * g.page_size + torch.arange(g.page_size)).reshape(-1)[
        :tokens
    ]  # other pages: the source survives
    lane, begin_store, begin_load, close = _pool_target(g, npages, threads, k, v, donor)
    try:
        nbytes = src_c.numel()
        counter = CpuLayerCounter(g.num_layers, timeout_s=120)

        def store():
            assert begin_store(slots).wait(120).ok

        def load():
            h = begin_load(dst, counter)
            counter.set_consumer(h.producer_id)
            for layer in range(g.num_layers):  # the consumer reads layers as they land
                assert counter.wait_until(layer)
            assert h.wait(120).ok

        def copy():  # the baseline runs on the same lane, with the same threads
            lane.submit(dst_c.copy_, src_c).result()

        for fn in (copy, store, load):
            fn()  # warm-up: page faults, thread start
        rounds = []
        while len(rounds) < repeats and (not rounds or time.monotonic() < deadline):
            rounds.append((_timed(copy), _timed(store), _timed(load)))
        same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731
        ok = all(
            same(k[i][dst], k[i][slots]) and same(v[i][dst], v[i][slots])
            for i in range(g.num_layers)
        )
    finally:
        close()
    t_copy = statistics.median(r[0] for r in rounds)
    t_store = statistics.median(r[1] for r in rounds)
    t_load = statistics.median(r[2] for r in rounds)
    # Ratios per round, then the median: rounds share whatever else the machine is doing.
    store_ratio = statistics.median(r[0] / r[1] for r in rounds)
    load_ratio = statistics.median(r[0] / r[2] for r in rounds)
    return {
        "page_size": g.page_size,
        "bytes": nbytes,
        "copy_gbps": nbytes / t_copy / 1e9,
        "store_gbps": nbytes / t_store / 1e9,
        "load_gbps": nbytes / t_load / 1e9,
        "store_ratio": store_ratio,
        "load_ratio": load_ratio,
        "load_ms_per_layer": t_load / g.num_layers * 1e3,
        "rounds": len(rounds),
        "verified": ok,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    tokens = args.tokens or (4096 if args.quick else 8192)
    repeats = args.repeats or (3 if args.quick else 5)
    page_sizes = [
        int(x) for x in (args.page_sizes or ("16,64" if args.quick else "16,32,64")).split(",")
    ]
    t0 = time.monotonic()
    donor_layers = args.donor_layers or args.layers
    print(
        f"path: CPU pool lease (PoolTransferEngine: unit gather + scatter through a staging "
        f"buffer) into a donor pool of {donor_layers} layers in POSIX shared memory, "
        f"donor pages a fresh grant; local pages shuffled; "
        f"torch {torch.__version__}, copy lane {args.threads} thread(s); baseline: one "
        f"contiguous copy of the same bytes on the same lane, rounds interleaved"
    )
    rows = []
    geoms = [
        KVGeometry(args.layers, args.kv_heads, args.head_dim, args.head_dim, args.dtype, ps)
        for ps in page_sizes
    ]
    big = max(page_sizes)
    pool = Pool(
        geoms[0],
        2 * -(-tokens // big) * big,
        tokens * geoms[0].bytes_per_token_per_layer * args.layers,
    )
    for g in geoms:
        ps = g.page_size
        # --quick keeps under 30 s on a busy machine: after the time share of this page size,
        # stop adding rounds (at least one is always timed)
        share = (QUICK_BUDGET_S if args.quick else 1e9) * (len(rows) + 1) / len(geoms)
        # same heads and dims; its own layer count and page size
        donor = KVGeometry(donor_layers, g.num_kv_heads, g.head_dim, g.v_head_dim, g.dtype,
                           args.donor_page_size or ps)
        r = bench_page_size(g, tokens, repeats, args.threads, pool, t0 + share, donor)
        rows.append(r)
        print(
            f"geometry: {g.num_layers} layers x {g.num_kv_heads} KV heads x {g.head_dim} "
            f"{args.dtype} = {g.bytes_per_token_per_layer} B/token/layer, page {ps}, "
            f"{tokens} tokens, {r['bytes'] / 2**20:.0f} MiB per direction"
            + f"; donor pool {donor.num_layers} layers, page {donor.page_size}"
        )
        print(
            f"  contiguous copy {r['copy_gbps']:7.2f} GB/s | store {r['store_gbps']:7.2f} GB/s "
            f"({r['store_ratio']:.2f}x) | layer-wise load "
            f"{r['load_gbps']:7.2f} GB/s ({r['load_ratio']:.2f}x, "
            f"{r['load_ms_per_layer']:.2f} ms/layer) | verified {r['verified']}"
        )
    summary = {
        "path": "cpu-pool-lease",
        "donor_layers": donor_layers,
        "donor_page_size": args.donor_page_size,
        "store_ratio": round(min(r["store_ratio"] for r in rows), 3),
        "load_ratio": round(min(r["load_ratio"] for r in rows), 3),
        "threads": args.threads,
        "store_gbps": [round(r["store_gbps"], 2) for r in rows],
        "load_gbps": [round(r["load_gbps"], 2) for r in rows],
        "copy_gbps": [round(r["copy_gbps"], 2) for r in rows],
        "page_sizes": page_sizes,
        "tokens": tokens,
        "layers": args.layers,
        "bytes_per_token_per_layer": rows[0]["bytes"] // tokens // args.layers,
        "verified": all(r["verified"] for r in rows),
        "rounds": [r["rounds"] for r in rows],
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(summary))
    return 0 if summary["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
