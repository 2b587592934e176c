#!/usr/bin/env python3
"""One prepared run of the data plane on a single NVIDIA GPU (written for an H200).

1. Compiles the Triton row copy (swift_kernels/row_copy_triton.py, the one-pass copy the pool
   leases use within one GPU) and checks it against the plain-torch reference on the GPU (1-,
   2-, 4- and 8-byte elements; scattered and reversed rows; a poisoned destination).
2. Pool leases (scripts/gpu_pool_check.py), one per page size: the donor places a pool of its
   own shape in one region exported through CUDA IPC (as the plugin places a lending server's
   SGLang pool) and lends some of its pages to a second process on the same GPU (this script,
   run with --role borrower), of another shape. The borrower maps it, stores a prefix with the
   pool-lease engine (one-pass Triton row copy), loads it back layer by layer on a side stream
   through the CUDA layer counter (events, no host blocking) and checks it is bit-identical,
   checks the packing rule, the two copy paths against each other, an exchange and, where two
   GPUs exist, the cross-device path (skipped with a message on one GPU); the donor checks its
   own buffers hold the borrower's stream.
3. The borrower measures store and per-layer load bandwidth of each lease against a
   device-to-device copy of the same bytes in the same run (target: at least 0.85x); the donor
   prints the table and, last, a JSON line.
4. Layer views with resident rows (sglang_swift/layer_stream/layer_views.py): each layer's
   buffer mapped with CUDA VMM from its own resident rows and a shared staging buffer; checks
   resident rows are per layer, staging rows shared by every depth-th layer, and a streamed
   SGLang pool with resident rows builds on the GPU.
5. Layer-streamed load (scripts/gpu_stream_check.py): a prefix loaded from donor pool pages
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
    """Bandwidth table: one row per pool lease (borrower page size), GB/s and the ratio to the
    same-run D2D copy."""
    head = (
        f"{'page':>5} {'donor':>9} {'MiB':>7} {'d2d GB/s':>9} {'store GB/s':>11} {'ratio':>6} "
        f"{'load GB/s':>10} {'ratio':>6} {'ms/layer':>9} {'unit B':>7}  path"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        sr, lr = r["store_gbps"] / r["copy_gbps"], r["load_gbps"] / r["copy_gbps"]
        flag = "" if min(sr, lr) >= target else f"  below {target}x"
        donor = f"{r['donor_layers']}L/p{r['donor_page_size']}"
        lines.append(
            f"{r['page_size']:>5} {donor:>9} {r['bytes'] / 2**20:>7.0f} {r['copy_gbps']:>9.1f} "
            f"{r['store_gbps']:>11.1f} {sr:>6.2f} {r['load_gbps']:>10.1f} {lr:>6.2f} "
            f"{r['load_ms_per_layer']:>9.3f} {r['unit']:>7}  {r['backend']}{flag}"
        )
    return "\n".join(lines)


def summarize(rows: list[dict], checks: dict, target: float) -> dict:
    ok = all(checks.values())
    out = {
        "ok": ok,
        "checks": checks,
        "target": target,
        "path": "pool-lease",
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
    """The Triton row copy against the plain-torch reference on the GPU, every element width."""
    import torch

    import swift_kernels as sk

    rows, width, n = (4096, 1024, 1500) if device.type == "cuda" else (64, 40, 20)
    results = {}
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
        g = torch.Generator(device="cpu").manual_seed(7)
        src = torch.randint(0, 100, (rows, width), generator=g).to(dtype).to(device)
        ok = True
        for kind in ("scattered", "reversed"):
            if kind == "scattered":
                src_rows = torch.randperm(rows, generator=g)[:n]
                dst_rows = torch.randperm(rows, generator=g)[:n]
            else:
                src_rows = torch.arange(n)
                dst_rows = torch.arange(rows - 1, rows - 1 - n, -1)
            src_rows, dst_rows = src_rows.to(device), dst_rows.to(device)
            ref = torch.full((rows, width), 0x5A, dtype=dtype, device=device)  # poisoned
            out = ref.clone()
            sk.copy_rows(src, src_rows, ref, dst_rows, backend="reference")
            sk.copy_rows(src, src_rows, out, dst_rows, backend="triton")
            _sync(device)
            ok = ok and torch.equal(out, ref) and torch.equal(out[dst_rows], src[src_rows])
        results[f"row_copy_{str(dtype).removeprefix('torch.')}"] = bool(ok)
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
    ok = all(bool(views[i][:, :resident].eq(i + 1).all()) for i in range(layers))
    ok = ok and bool(views[2][:, resident:].eq(7).all()) and not bool(
        views[1][:, resident:].eq(7).any())
    from sglang_swift.layer_stream.pool import LayerStreamKVPool, StreamSettings

    cls = LayerStreamKVPool.configured(StreamSettings(depth=2, resident_fraction=0.5))
    pool = cls(size=4 * grain // 256, page_size=1, dtype=torch.float16, head_num=1,
               head_dim=128, layer_num=4, device=str(device), enable_memory_saver=False)
    return {"layer_views_aliasing": ok, "layer_views_pool_resident": pool.resident_rows > 0,
            "layer_views_granularity": grain}


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


def borrower(args) -> int:
    """Second process: map each donor pool through CUDA IPC, verify, measure; JSON on stdout."""
    import torch
    from gpu_pool_check import borrower_pool_checks

    msg = json.loads(sys.stdin.readline())
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    checks, rows, infos = {}, [], []
    for pool_msg in msg["pools"]:
        got, row, info = borrower_pool_checks(args, pool_msg, device, _local_pool, _cuda_time,
                                              args.dry_run_cpu)
        for name, ok in got.items():  # every lease must pass each check
            checks[name] = checks.get(name, True) and ok
        rows.append(row)
        infos.append(info)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps({"checks": checks, "rows": rows, "pool_infos": infos}), flush=True)
    return 0


def _borrower_command(args) -> list[str]:
    return [sys.executable, __file__, "--role", "borrower", "--device", args.device,
            "--tokens", str(args.tokens), "--page-sizes", ",".join(map(str, args.page_sizes)),
            "--layers", str(args.layers), "--kv-heads", str(args.kv_heads), "--head-dim",
            str(args.head_dim), "--dtype", args.dtype, "--repeats", str(args.repeats)] + (
        ["--dry-run-cpu"] if args.dry_run_cpu else [])


def _run_borrower(args, pools) -> dict:
    """The borrower process's result, or failed checks when it did not answer."""
    child = subprocess.Popen(_borrower_command(args), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        out, _ = child.communicate(json.dumps({"pools": [p[-1] for p in pools]}) + "\n",
                                   timeout=480)
        return json.loads(out.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        child.kill()
        print(f"borrower failed: {e!r}")
        return {"checks": {"borrower": False}, "rows": []}
    finally:
        if child.poll() is None:
            child.kill()


def donor(args) -> int:
    import torch

    if not torch.cuda.is_available() and not args.dry_run_cpu:
        print(NO_CUDA)
        return 2
    import triton

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
    print(f"row copy vs reference: {checks} ({time.monotonic() - t0:.1f} s incl. compile)")
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
    from gpu_pool_check import make_donor_pool, stream_checksum

    pools = [list(make_donor_pool(args, device, ps)) for ps in args.page_sizes]
    kind = pools[0][-1]["desc"]["kind"]
    print(f"donor pools: {len(pools)} on {device}, exported as {kind}")
    result = _run_borrower(args, pools)
    checks.update(result["checks"])
    for (_, layout, (pool_k, pool_v), pages, _), info in zip(pools,
                                                              result.get("pool_infos", [])):
        seen = stream_checksum(pool_k, pool_v, layout.geometry.page_size, pages, info["used"])
        checks["pool_donor_sees_bytes"] = (checks.get("pool_donor_sees_bytes", True)
                                           and seen == info["checksum"])
        print(f"pool lease: {info['blocks']} borrower blocks in {len(pages)} donor pages, "
              f"unit {info['unit']} B, copy path {info['backend']}; "
              f"cross-device: {info['cross_device']}")
    for pool in pools:
        pool[2] = pool_k = pool_v = None  # the donor's views of its region, before it goes
        pool[0].close()
    rows = result["rows"]
    print(
        f"bandwidth of pool leases through {kind}, borrower {args.layers} layers x "
        f"{args.kv_heads} KV heads x {args.head_dim} {args.dtype}; donor pool 4 more layers, "
        f"half the page; store and layer-wise load through the engine (side stream, one event "
        f"per layer, consumer stream waits)"
    )
    print(format_table(rows, args.target))
    summary = summarize(rows, checks, args.target)
    summary["stream"] = {k: stream[k] for k in ("ratio", "target", "resident_ms", "streamed_ms",
                                                 "tokens")}
    if rows:
        summary["pool"] = {"backend": rows[-1]["backend"], "unit": rows[-1]["unit"]}
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
