#!/usr/bin/env python3
"""One prepared run of the data plane on a single NVIDIA GPU (written for an H200).

1. Compiles the Triton store / load kernels and checks them against the plain-torch reference
   on the GPU (float16, bfloat16, float32; paged and scattered slots; a partial last page; a
   poisoned destination).
2. Exports an arena through CUDA IPC to a second process on the same GPU (this script, run with
   --role borrower); the borrower maps it, stores a prefix with the Triton kernels, loads it back
   layer by layer on a side stream through the CUDA layer counter (events, no host blocking),
   checks it is bit-identical, and the donor checks its own memory holds the bytes.
3. The borrower measures store and per-layer load bandwidth on the mapped arena against a
   device-to-device copy of the same bytes in the same run (target: at least 0.85x), sweeping a
   few launch shapes; the donor prints the table and, last, a JSON line.
4. Pool leases (scripts/gpu_pool_check.py): the donor also lends pages of a live pool region of
   another shape; the borrower maps it through CUDA IPC, stores and loads layer by layer with
   the pool-lease engine (one-pass Triton row copy), checks the bytes, the packing rule, the
   two copy paths against each other and, where two GPUs exist, the cross-device path (skipped
   with a message on one GPU); the donor checks its own buffers hold the borrower's stream.
5. Layer views with resident rows (sglang_swift/layer_stream/layer_views.py): each layer's
   buffer mapped with CUDA VMM from its own resident rows and a shared staging buffer; checks
   resident rows are per layer, staging rows shared by every depth-th layer, and a streamed
   SGLang pool with resident rows builds on the GPU.
6. Layer-streamed load (scripts/gpu_stream_check.py): a prefix loaded from donor pool pages
   layer by layer on the engine's side stream while attention runs per layer, waiting on the
   CUDA layer counter only for its layer, timed against the same attention with everything
   resident (target: at most 1.10x), and checked bit-identical.

Exit status: 0 when every check passed (bandwidth below target is reported, not failed),
1 when a check failed, 2 when there is no CUDA device (nothing run).
Run from the repository root: `python3 scripts/gpu_check.py` (about a minute; --quick less).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NO_CUDA = (
    "gpu_check: no CUDA device is visible here, so nothing was run. This script needs one "
    "NVIDIA GPU (it was written for an H200); on CPU use scripts/bench_transfer.py and "
    "the CPU tests."
)
TUNINGS = [
    {"block": 1024, "tokens": 1, "num_warps": 4},
    {"block": 1024, "tokens": 4, "num_warps": 4},
    {"block": 1024, "tokens": 8, "num_warps": 8},
    {"block": 512, "tokens": 4, "num_warps": 4},
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4096 tokens, fewer repeats")
    p.add_argument("--tokens", type=int, default=None, help="prefix length (default 32768)")
    p.add_argument("--page-sizes", default="16,64")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 20)")
    p.add_argument("--target", type=float, default=0.85)
    p.add_argument("--device", default="cuda:0")
    p.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="run the whole flow on CPU (shm instead of CUDA IPC, Triton interpreted, "
        "host timers) at toy size: tests the script, measures nothing",
    )
    p.add_argument("--json-out", default=None, help="also write the final JSON here")
    p.add_argument("--role", choices=["donor", "borrower"], default="donor", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tokens is None:
        args.tokens = 4096 if args.quick else 32768
    if args.repeats is None:
        args.repeats = 5 if args.quick else 20
    args.page_sizes = [int(x) for x in str(args.page_sizes).split(",")]
    if args.dry_run_cpu:
        args.device = "cpu"
    if min(args.tokens, args.layers, args.repeats, *args.page_sizes) <= 0:
        p.error("tokens, layers, repeats and page sizes must be positive")
    return args


def format_table(rows: list[dict], target: float) -> str:
    """Bandwidth table: one row per page size, GB/s and the ratio to the same-run D2D copy."""
    head = (
        f"{'page':>5} {'MiB':>7} {'d2d GB/s':>9} {'store GB/s':>11} {'ratio':>6} "
        f"{'load GB/s':>10} {'ratio':>6} {'ms/layer':>9}  tuning (store | load)"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        sr, lr = r["store_gbps"] / r["copy_gbps"], r["load_gbps"] / r["copy_gbps"]
        flag = "" if min(sr, lr) >= target else f"  below {target}x"
        lines.append(
            f"{r['page_size']:>5} {r['bytes'] / 2**20:>7.0f} {r['copy_gbps']:>9.1f} "
            f"{r['store_gbps']:>11.1f} {sr:>6.2f} {r['load_gbps']:>10.1f} {lr:>6.2f} "
            f"{r['load_ms_per_layer']:>9.3f}  {_tuning_str(r.get('store_tuning'))} | "
            f"{_tuning_str(r.get('load_tuning'))}{flag}"
        )
    return "\n".join(lines)


def _tuning_str(t) -> str:
    return "-" if not t else f"B{t['block']}/T{t['tokens']}/W{t['num_warps']}"


def summarize(rows: list[dict], checks: dict, target: float) -> dict:
    ok = all(checks.values())
    out = {
        "ok": ok,
        "checks": checks,
        "target": target,
        "path": "triton",
        "store_ratio": None,
        "load_ratio": None,
        "rows": rows,
    }
    if rows:
        out["store_ratio"] = round(min(r["store_gbps"] / r["copy_gbps"] for r in rows), 3)
        out["load_ratio"] = round(min(r["load_gbps"] / r["copy_gbps"] for r in rows), 3)
    return out


# ---- on the GPU ------------------------------------------------------------------------------
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cuda_time(fn, repeats: int, device) -> float:
    import torch

    fn()
    _sync(device)
    if device.type != "cuda":  # --dry-run-cpu: host timer
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def check_kernels(device) -> dict:
    """Triton vs reference on the GPU, small sizes, every dtype and slot pattern."""
    import torch

    import swift_kernels as sk
    from sglang_swift.dataplane import block_bytes_for

    results = {}
    L, H, DK, DV, P, N, S, NB = 3, 4, 64, 32, 16, 77, 512, 12
    if device.type != "cuda":  # dry run: interpreted Triton, keep it small
        L, H, DK, DV, P, N, S, NB = 2, 1, 16, 8, 4, 9, 32, 4
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        geom = sk.KVGeometry(L, H, DK, DV, dtype, P)
        bb = block_bytes_for(geom)
        for kind in ("pages", "scattered"):
            g = torch.Generator(device="cpu").manual_seed(7)
            k = [torch.randn(S, H, DK, generator=g).to(dtype).to(device) for _ in range(L)]
            v = [torch.randn(S, H, DV, generator=g).to(dtype).to(device) for _ in range(L)]
            npg = -(-N // P)
            blocks = torch.randperm(NB, generator=g)[:npg].to(device)
            if kind == "pages":
                pages = torch.randperm(S // P, generator=g)[:npg]
                slots = (pages[:, None] * P + torch.arange(P)).reshape(-1)[:N].to(device)
            else:
                slots = torch.randperm(S, generator=g)[:N].to(device)
            ref = torch.full((NB, bb), 0xA5, dtype=torch.uint8, device=device)
            out = ref.clone()
            sk.store_pages(ref, k, v, slots, blocks, geom, backend="reference")
            sk.store_pages(out, k, v, slots, blocks, geom, backend="triton")
            ok = torch.equal(out, ref)
            for layer in range(L):
                rk = torch.full_like(k[0], float("nan"))
                rv = torch.full_like(v[0], float("nan"))
                ok_k, ok_v = rk.clone(), rv.clone()
                sk.load_layer(ref, layer, rk, rv, slots, blocks, geom, backend="reference")
                sk.load_layer(ref, layer, ok_k, ok_v, slots, blocks, geom, backend="triton")
                same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa
                ok = ok and same(ok_k, rk) and same(ok_v, rv)
                ok = ok and torch.equal(ok_k[slots], k[layer][slots])
            _sync(device)
            results[f"kernels_{str(dtype).removeprefix('torch.')}_{kind}"] = bool(ok)
    return results


def check_layer_views(device) -> dict:
    """Part 5: VMM-mapped layer buffers behave as the pool needs (CPU dry run: memfd)."""
    import torch

    from sglang_swift.layer_stream.layer_views import LayerViews, aligned_rows, granularity

    layers, depth, shape = 4, 2, (8, 128)
    row_bytes = 8 * 128 * 2
    grain = granularity(device)
    resident, rows = aligned_rows(3 * grain // row_bytes, 5 * grain // row_bytes, row_bytes,
                                  grain, 1)
    views = LayerViews(layers, depth, resident, rows, shape, torch.float16, device).views
    for layer in range(layers):
        views[layer][:, :resident].fill_(layer + 1)
    views[0][:, resident:].fill_(7)
    ok = all(bool(views[l][:, :resident].eq(l + 1).all()) for l in range(layers))
    ok = ok and bool(views[2][:, resident:].eq(7).all()) and not bool(views[1][:, resident:].eq(7).any())
    from sglang_swift.layer_stream.pool import LayerStreamKVPool, StreamSettings

    cls = LayerStreamKVPool.configured(StreamSettings(depth=2, resident_fraction=0.5))
    pool = cls(size=4 * grain // 256, page_size=1, dtype=torch.float16, head_num=1,
               head_dim=128, layer_num=4, device=str(device), enable_memory_saver=False)
    return {"layer_views_aliasing": ok, "layer_views_pool_resident": pool.resident_rows > 0,
            "layer_views_granularity": grain}


def _checksum(memory, blocks) -> int:
    import torch

    idx = torch.as_tensor(blocks, device=memory.device)
    return int(memory[idx].view(torch.int64).sum())


def _local_pool(g, num_slots, device, seed):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)

    def mk(d):
        shape = (num_slots, g.num_kv_heads, d)
        return torch.randint(
            -(2**15), 2**15, shape, dtype=torch.int16, device=device, generator=gen
        )

    if g.dtype.itemsize == 2:
        return (
            [mk(g.head_dim).view(g.dtype) for _ in range(g.num_layers)],
            [mk(g.v_head_dim).view(g.dtype) for _ in range(g.num_layers)],
        )
    return (
        [
            torch.randn(num_slots, g.num_kv_heads, g.head_dim, device=device, generator=gen).to(
                g.dtype
            )
            for _ in range(g.num_layers)
        ],
        [
            torch.randn(num_slots, g.num_kv_heads, g.v_head_dim, device=device, generator=gen).to(
                g.dtype
            )
            for _ in range(g.num_layers)
        ],
    )


def _borrow_page_size(args, mapped, lease, ps, device):
    """Round trip and bandwidth for one page size on the mapped arena: (round trip ok, row)."""
    import torch

    import swift_kernels as sk
    from sglang_swift.dataplane import KVGeometry, TransferEngine, make_layer_counter

    g = KVGeometry(args.layers, args.kv_heads, args.head_dim, args.head_dim, args.dtype, ps)
    npages = -(-args.tokens // ps)
    num_slots = 2 * npages * ps
    k, v = _local_pool(g, num_slots, device, seed=ps)
    perm = torch.randperm(num_slots // ps, device=device)
    ar = torch.arange(ps, device=device)
    slots = (perm[:npages, None] * ps + ar).reshape(-1)[: args.tokens]
    dst = (perm[npages : 2 * npages, None] * ps + ar).reshape(-1)[: args.tokens]
    blocks = torch.tensor(lease[:npages], device=device)
    eng = TransferEngine(
        mapped.memory,
        g,
        liveness=mapped.alive,
        backend="triton" if args.dry_run_cpu else "auto",
    )
    counter = make_layer_counter(g.num_layers, device, timeout_s=60)
    # -- correctness through the engine: Triton store, layer-wise load, event waits
    assert eng.begin_store(k, v, slots, blocks).wait(60).ok
    k2 = [torch.full_like(x, float("nan")) for x in k]
    v2 = [torch.full_like(x, float("nan")) for x in v]
    h = eng.begin_load(k2, v2, dst, blocks, counter)
    counter.set_consumer(h.producer_id)
    same = True
    for layer in range(g.num_layers):
        same &= counter.wait_until(layer)  # current stream waits on the layer's event
        same &= torch.equal(k2[layer][dst].view(torch.int8), k[layer][slots].view(torch.int8))
        same &= torch.equal(v2[layer][dst].view(torch.int8), v[layer][slots].view(torch.int8))
    ok = bool(same and h.wait(60).ok)
    # -- bandwidth: best launch shape for store and for load, then the engine's path
    nbytes = args.tokens * g.bytes_per_token_per_layer * g.num_layers
    src_c = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst_c = torch.empty_like(src_c)

    def copy():
        dst_c.copy_(src_c)

    t_copy = _cuda_time(copy, args.repeats, device)

    def layers(op, tuning):
        def run():
            for layer in range(g.num_layers):
                op(
                    mapped.memory,
                    layer,
                    k[layer],
                    v[layer],
                    slots if op is sk.store_layer else dst,
                    blocks,
                    g,
                    backend="triton",
                    tuning=tuning,
                    validate=False,
                )

        return run

    tunings = TUNINGS[:2] if args.dry_run_cpu else TUNINGS
    store_t = {
        i: _cuda_time(layers(sk.store_layer, t), args.repeats, device)
        for i, t in enumerate(tunings)
    }
    load_t = {
        i: _cuda_time(layers(sk.load_layer, t), args.repeats, device) for i, t in enumerate(tunings)
    }
    best_s, best_l = min(store_t, key=store_t.get), min(load_t, key=load_t.get)
    eng.tuning = TUNINGS[best_l]

    def engine_load():
        hh = eng.begin_load(k, v, dst, blocks, counter)
        counter.set_consumer(hh.producer_id)
        for layer in range(g.num_layers):
            counter.wait_until(layer)

    t_engine_load = _cuda_time(engine_load, args.repeats, device)
    _sync(device)
    eng.close()
    return ok, (
        {
            "page_size": ps,
            "bytes": nbytes,
            "copy_gbps": nbytes / t_copy / 1e9,
            "store_gbps": nbytes / store_t[best_s] / 1e9,
            "load_gbps": nbytes / t_engine_load / 1e9,
            "load_kernel_gbps": nbytes / load_t[best_l] / 1e9,
            "load_ms_per_layer": t_engine_load / g.num_layers * 1e3,
            "store_tuning": TUNINGS[best_s],
            "load_tuning": TUNINGS[best_l],
            "all_store_gbps": [round(nbytes / t / 1e9, 1) for t in store_t.values()],
            "all_load_gbps": [round(nbytes / t / 1e9, 1) for t in load_t.values()],
        }
    )


def borrower(args) -> int:
    """Second process: map the donor's arena through CUDA IPC, verify, measure; JSON on stdout."""
    import torch

    from sglang_swift.dataplane import map_arena

    msg = json.loads(sys.stdin.readline())
    desc = {**msg["desc"], "handle": bytes.fromhex(msg["desc"]["handle"])}
    lease = msg["blocks"]
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mapped = map_arena(desc)
    from gpu_pool_check import borrower_pool_checks

    pool_checks, pool_row, pool_info = borrower_pool_checks(
        args, msg["pool"], device, _local_pool, _cuda_time, args.dry_run_cpu)
    checks, rows, last = dict(pool_checks), [], None
    for ps in args.page_sizes:
        ok, row = _borrow_page_size(args, mapped, lease, ps, device)
        checks[f"ipc_roundtrip_page{ps}"] = ok
        rows.append(row)
        npages = -(-args.tokens // ps)
        last = (npages, _checksum(mapped.memory, lease[:npages]))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        json.dumps(
            {"checks": checks, "rows": rows, "checksum_blocks": last[0], "checksum": last[1],
             "pool_row": pool_row, "pool_info": pool_info}
        ),
        flush=True,
    )
    mapped.close()
    return 0


def donor(args) -> int:
    import torch

    if not torch.cuda.is_available() and not args.dry_run_cpu:
        print(NO_CUDA)
        return 2
    import triton

    from sglang_swift.dataplane import KVGeometry, SharedArena, choose_block_bytes

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        print(
            f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
            f"triton {triton.__version__}, {torch.cuda.device_count()} GPU(s)"
        )
    else:
        print(
            f"DRY RUN on CPU (shm instead of CUDA IPC, Triton interpreted): the flow is "
            f"exercised, the numbers mean nothing; torch {torch.__version__}, triton "
            f"{triton.__version__}"
        )
    t0 = time.monotonic()
    checks = check_kernels(device)
    print(f"kernels vs reference: {checks} ({time.monotonic() - t0:.1f} s incl. compile)")
    views = check_layer_views(device)
    print(f"layer views with resident rows: {views}")
    checks.update(layer_views_aliasing=views["layer_views_aliasing"],
                  layer_views_pool_resident=views["layer_views_pool_resident"])
    from gpu_stream_check import run_stream_check

    stream = run_stream_check(args, device, _cuda_time)
    checks["stream_load_bit_identical"] = stream["ok"]
    print(f"layer-streamed load under attention ({stream['backend']}): {stream['tokens']} tokens "
          f"({stream['kv_mib_per_layer']} MiB of KV per layer), {stream['new_tokens']} new "
          f"tokens: resident {stream['resident_ms']} ms, streamed {stream['streamed_ms']} ms, "
          f"ratio {stream['ratio']} (target <= {stream['target']})")
    geoms = [
        KVGeometry(args.layers, args.kv_heads, args.head_dim, args.head_dim, args.dtype, ps)
        for ps in args.page_sizes
    ]
    num_blocks = max(-(-args.tokens // g.page_size) for g in geoms) + 8
    arena = SharedArena(num_blocks, choose_block_bytes(geoms), device=str(device))
    # The borrower's blocks: the first ones, as a fresh grant from the donor's ledger hands out
    # (control/ledger.py is not imported here: this script needs only torch and triton).
    lease = list(range(num_blocks - 8))
    from gpu_pool_check import make_donor_pool, stream_checksum

    pool_arena, pool_layout, (pool_k, pool_v), pool_pages, pool_msg = make_donor_pool(args, device)
    desc = arena.export()
    print(
        f"arena: {num_blocks} blocks x {arena.block_bytes / 2**20:.1f} MiB on {device}, "
        f"exported as {desc['kind']} ({len(desc['handle'])}-byte handle)"
    )
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--role",
            "borrower",
            "--device",
            args.device,
            "--tokens",
            str(args.tokens),
            "--page-sizes",
            ",".join(map(str, args.page_sizes)),
            "--layers",
            str(args.layers),
            "--kv-heads",
            str(args.kv_heads),
            "--head-dim",
            str(args.head_dim),
            "--dtype",
            args.dtype,
            "--repeats",
            str(args.repeats),
        ]
        + (["--dry-run-cpu"] if args.dry_run_cpu else []),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        out, _ = child.communicate(
            json.dumps({"desc": {**desc, "handle": desc["handle"].hex()}, "blocks": lease,
                        "pool": pool_msg}) + "\n",
            timeout=480,
        )
        result = json.loads(out.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        child.kill()
        print(f"borrower failed: {e!r}")
        result = {"checks": {"borrower": False}, "rows": []}
    finally:
        if child.poll() is None:
            child.kill()
    checks.update(result["checks"])
    if "checksum" in result:
        donor_sum = _checksum(arena.memory, lease[: result["checksum_blocks"]])
        checks["donor_sees_borrower_bytes"] = donor_sum == result["checksum"]
    arena.close()
    pool_info, pool_row = result.get("pool_info"), result.get("pool_row")
    if pool_info is not None:
        seen = stream_checksum(pool_k, pool_v, pool_layout.geometry.page_size, pool_pages,
                               pool_info["used"])
        checks["pool_donor_sees_bytes"] = seen == pool_info["checksum"]
        print(f"pool lease: {pool_info['blocks']} borrower blocks in {len(pool_pages)} donor "
              f"pages, unit {pool_info['unit']} B, copy path {pool_info['backend']}; "
              f"cross-device: {pool_info['cross_device']}")
    if pool_row is not None:
        print(f"pool lease bandwidth (borrower page {pool_row['page_size']}, donor "
              f"{pool_row['donor_layers']} layers page {pool_row['donor_page_size']}): copy "
              f"{pool_row['copy_gbps']:.1f} GB/s, store {pool_row['store_gbps']:.1f} "
              f"({pool_row['store_gbps'] / pool_row['copy_gbps']:.2f}x), layer-wise load "
              f"{pool_row['load_gbps']:.1f} ({pool_row['load_gbps'] / pool_row['copy_gbps']:.2f}x"
              f", {pool_row['load_ms_per_layer']:.3f} ms/layer)")
    del pool_k, pool_v
    pool_arena.close()
    rows = result["rows"]
    print(
        f"bandwidth on the {desc['kind']}-mapped arena, {args.layers} layers x {args.kv_heads} "
        f"KV heads x {args.head_dim} {args.dtype} ({geoms[0].bytes_per_token_per_layer} "
        f"B/token/layer), {args.tokens} tokens; store = best launch shape; load = layer-wise "
        f"through the engine (side stream, one event per layer, consumer stream waits)"
    )
    print(format_table(rows, args.target))
    summary = summarize(rows, checks, args.target)
    summary["stream"] = {k: stream[k] for k in ("ratio", "target", "resident_ms", "streamed_ms",
                                                 "tokens")}
    if pool_row is not None:
        summary["pool"] = {"store_ratio": round(pool_row["store_gbps"] / pool_row["copy_gbps"], 3),
                           "load_ratio": round(pool_row["load_gbps"] / pool_row["copy_gbps"], 3),
                           "backend": pool_row["backend"]}
    line = json.dumps(
        {k: summary[k] for k in ("ok", "path", "store_ratio", "load_ratio", "target", "checks",
                                 "pool", "stream") if k in summary}
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=1))
    print(line)
    return 0 if summary["ok"] else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run_cpu:  # read when triton decorates the kernels: set before any import of it
        os.environ["TRITON_INTERPRET"] = "1"
    return borrower(args) if args.role == "borrower" else donor(args)


if __name__ == "__main__":
    sys.exit(main())
