"""How long an eviction's store holds the scheduler thread on CPU (docs/streaming.md, "What the
scheduler thread waits for").

A borrower's demotion store runs on the scheduler thread (`integration/copies.store_now`): the
victims' K and V of every layer go into donor pool pages before the eviction returns. This
times that copy for the `small` model's KV (8 layers, 4 KV heads of 32, fp32: 8 KiB a token)
into a pool laid out for the `tiny` model (the donor of `scripts/bench_overlap.py`), idle and
while the copy thread runs loads of the same lease beside it (a streamed donor hit). Victims'
slots are scattered over the pool, as an LRU eviction's are. Prints one JSON line per size and
a last line with the per-token cost and bandwidth.

    python scripts/bench_evict_store.py [--tokens 64 512 1536 4096] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from types import SimpleNamespace

import torch

from sglang_swift.dataplane import KVGeometry, LeasePacking, PoolLayout, PoolTransferEngine
from sglang_swift.dataplane.layer_counter import CpuLayerCounter
from sglang_swift.dataplane.streams import CpuLane
from sglang_swift.integration.copies import store_now

SMALL = KVGeometry(8, 4, 32, 32, "float32", 1)
TINY = KVGeometry(4, 2, 32, 32, "float32", 1)


def build(rows: int, donor_pages: int):
    k = [torch.randn(rows, SMALL.num_kv_heads, SMALL.head_dim) for _ in range(SMALL.num_layers)]
    v = [torch.randn(rows, SMALL.num_kv_heads, SMALL.head_dim) for _ in range(SMALL.num_layers)]
    layout = PoolLayout(TINY, rows=donor_pages, padded_rows=donor_pages, data_offset=0)
    region = torch.zeros(layout.data_bytes, dtype=torch.uint8)
    packing = LeasePacking(SMALL, layout, list(range(donor_pages)))
    engine = PoolTransferEngine(packing, region, k, v, lane=CpuLane())
    runtime = SimpleNamespace(lease_engine=lambda donor, lease: engine)
    return engine, runtime, packing.num_blocks


def loads_beside(engine, rows: int, blocks: int, stop: threading.Event) -> threading.Thread:
    """Keep the copy thread busy with loads of the lease's upper half into the pool's top rows."""
    n = min(4096, blocks // 2, rows // 4)

    def run():
        counter = CpuLayerCounter(SMALL.num_layers, timeout_s=60, num_counters=1)
        slots = torch.arange(rows - n, rows)
        src = list(range(blocks - n, blocks))
        while not stop.is_set():
            engine.begin_load(slots, src, counter).wait(60)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 1536, 4096])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    rows = 4 * max(args.tokens) + 8192
    engine, runtime, blocks = build(rows, donor_pages=4 * max(args.tokens) + 16384)
    gen = torch.Generator().manual_seed(0)
    token_bytes = SMALL.num_layers * 2 * SMALL.num_kv_heads * SMALL.head_dim * 4
    per_token = []
    for beside in (False, True):
        stop = threading.Event()
        worker = loads_beside(engine, rows, blocks, stop) if beside else None
        for n in args.tokens:
            times = []
            for _ in range(args.repeats):
                slots = torch.randperm(rows - 8192, generator=gen)[:n].tolist()
                dst = torch.randperm(blocks // 2, generator=gen)[:n].tolist()
                t0 = time.perf_counter()
                ok, enqueued = store_now(runtime, ("d", 0), slots, dst)
                times.append(time.perf_counter() - t0)
                assert ok and enqueued is None
            p50, worst = statistics.median(times), max(times)
            per_token.append(p50 / n)
            print(json.dumps({"tokens": n, "mib": round(n * token_bytes / 2**20, 2),
                              "loads_beside": beside, "p50_ms": round(p50 * 1e3, 3),
                              "max_ms": round(worst * 1e3, 3),
                              "gb_per_s": round(n * token_bytes / p50 / 1e9, 2)}), flush=True)
        stop.set()
        if worker is not None:
            worker.join()
    big = [t for t, n in zip(per_token, args.tokens * 2) if n == max(args.tokens)]
    print(json.dumps({"token_bytes": token_bytes,
                      "us_per_token_largest": [round(t * 1e6, 3) for t in big],
                      "gb_per_s_largest": [round(token_bytes / t / 1e9, 2) for t in big]}))
    engine.lane.close()


if __name__ == "__main__":
    main()
