#!/usr/bin/env python3
"""The one prepared check of SwiftCache's GPU data plane, on one NVIDIA GPU (H100 or H200).

Needs python3 with torch (and Triton for part 2) and this repository only: no SGLang, ZMQ or
msgspec, nothing installed. `--emulate` runs the same checks on CPU through the emulated
asynchronous device (sglang_swift/dataplane/emulated.py), which is how CI runs them. The JSON of
what has finished is written after each part (to $OUT/gpu_check.json, or --json-out), so a run
cut short keeps its parts; the last line printed is the whole JSON. Exit status: 0 when every
check passed, 1 when one failed, 2 when no CUDA device is visible (without --emulate).

1. `ipc_lease`: a donor process places a pool of its own shape in one region exported by CUDA IPC
   (shared memory with --emulate) and lends its pages; this process, a borrower of another
   shape, maps it, stores a prefix with the pool-lease engine and loads it back layer by layer
   through `BatchLayerCounter`; the bytes must come back identical.
2. `kernels`: the Triton row copy against the plain-torch reference (1-, 2-, 4-, 8-byte rows).
3. `stream`: the streamed load under a forward stand-in on its own stream (attention per layer
   waits on the counter for its layer only): `overlap_ratio` is the share of the load's copy
   time hidden under the forward ((copy + forward - both) / copy); the copy's GB/s beside a
   same-run torch copy of as many bytes.
4. `fence`: loads run while a reclaim fences every block from another thread; right after the
   fence returns (the ack) the donor overwrites its pages; `poisoned_bytes_accepted` counts bytes
   of loads the borrower accepted that differ from what it stored (must be 0).
5. `syncs`: the scheduler-thread hooks every step runs (a store, a load begun and sealed,
   polling, the confirm of a finished copy) under `torch.cuda.set_sync_debug_mode("error")`
   (with --emulate: the emulated device's log of host waits made by the calling thread):
   `syncs_on_scheduler_path` counts what they wait for (must be 0). The one wait left on an
   exception path (a confirm while the copy still runs) is listed in `syncs_named`, with why.
6. `donor_killed`: the donor is SIGKILLed while mapped; loads after it fail cleanly (no crash,
   nothing accepted).

Run from the repository root: `python3 scripts/gpu_check.py` (--quick: smaller, about a minute).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

POISON = 0xA5
NO_CUDA = ("gpu_check: no CUDA device is visible here, so nothing was run; on CPU run "
           "`python scripts/gpu_check.py --emulate` (the same checks on the emulated device)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--emulate", action="store_true",
                   help="run on CPU through the emulated asynchronous device")
    p.add_argument("--quick", action="store_true", help="a smaller prefix and fewer repeats")
    p.add_argument("--tokens", type=int, default=None, help="prefix length")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement")
    p.add_argument("--json-out", default=None, help="where the JSON goes ($OUT/gpu_check.json)")
    p.add_argument("--role", choices=["borrower", "donor"], default="borrower",
                   help=argparse.SUPPRESS)
    p.add_argument("--donor-rows", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tokens is None:
        args.tokens = 16384 if args.emulate else (16384 if args.quick else 65536)
    if args.repeats is None:
        args.repeats = 3 if (args.quick or args.emulate) else 5
    if args.tokens <= 0 or args.repeats <= 0:
        p.error("--tokens and --repeats must be positive")
    if args.json_out is None and os.environ.get("OUT"):
        args.json_out = str(Path(os.environ["OUT"]) / "gpu_check.json")
    return args


def geometries(emulate: bool):
    """(borrower, donor) page shapes: two different models, as on a real node."""
    from swift_kernels import KVGeometry

    if emulate:
        return KVGeometry(8, 2, 64, 64, "float16", 16), KVGeometry(6, 4, 32, 32, "float16", 16)
    return (KVGeometry(32, 8, 128, 128, "bfloat16", 16),  # a Qwen3-8B-like borrower
            KVGeometry(28, 4, 128, 128, "bfloat16", 16))


# ---- the device: a GPU or the emulated one, behind one small surface ---------------------------
class Device:
    def __init__(self, emulate: bool):
        from sglang_swift.dataplane import EmulatedDevice

        self.emulated = EmulatedDevice() if emulate else None
        self.torch = torch.device("cpu" if emulate else "cuda:0")
        self.lane_device = self.emulated or self.torch

    def stream(self, name: str):
        return self.emulated.Stream(name) if self.emulated else torch.cuda.Stream(self.torch)

    def use(self, stream):
        return self.emulated.stream(stream) if self.emulated else torch.cuda.stream(stream)

    def launch(self, fn) -> None:
        if self.emulated:
            self.emulated.launch(fn)
        else:
            fn()

    def synchronize(self) -> None:
        if self.emulated:
            self.emulated.synchronize()
        else:
            torch.cuda.synchronize(self.torch)

    def timed(self, fn) -> float:
        """Seconds from issue to the device finishing what `fn` issued."""
        self.synchronize()
        t0 = time.perf_counter()
        fn()
        self.synchronize()
        return time.perf_counter() - t0


class Report:
    """The JSON, written after each part."""

    def __init__(self, path: str | None, emulate: bool):
        self.path = path
        self.data: dict = {"device": "emulated (CPU)" if emulate else _gpu_name(),
                           "torch": torch.__version__, "parts": {}, "ok": True}

    def part(self, name: str, result: dict) -> None:
        self.data["parts"][name] = result
        self.data["ok"] = self.data["ok"] and bool(result.get("ok"))
        self.write()

    def write(self) -> None:
        if self.path:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.path).write_text(json.dumps(self.data, indent=1, default=str) + "\n")


def _gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


# ---- the donor process -----------------------------------------------------------------------
def donor(args) -> int:
    """Place a pool in an exported region, print its descriptor, then obey stdin: `poison`
    (overwrite the pool's bytes, then answer `poisoned`), `exit`."""
    from sglang_swift.dataplane import PoolLayout, SharedArena
    from sglang_swift.dataplane.block_size import BLOCK_ALIGN_BYTES

    _, g = geometries(args.emulate)
    device = "cpu" if args.emulate else "cuda:0"
    layout = PoolLayout(g, rows=args.donor_rows, padded_rows=args.donor_rows, data_offset=0)
    size = -(-layout.data_bytes // BLOCK_ALIGN_BYTES) * BLOCK_ALIGN_BYTES
    arena = SharedArena(size, device=device, name_prefix="gpucheck")
    arena.memory.view(-1).zero_()
    desc = arena.export()
    desc["handle"] = desc["handle"].hex()
    desc["layout"] = layout.to_dict()
    print(json.dumps(desc), flush=True)
    for line in sys.stdin:
        if line.strip() == "poison":
            arena.memory.view(-1).fill_(POISON)
            if not args.emulate:
                torch.cuda.synchronize()
            print("poisoned", flush=True)
        elif line.strip() == "exit":
            break
    arena.close()
    return 0


class DonorProcess:
    def __init__(self, args, rows: int):
        cmd = [sys.executable, __file__, "--role", "donor", "--donor-rows", str(rows)]
        cmd += ["--emulate"] if args.emulate else []
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the donor process exited ({self.proc.wait()}) before exporting")
        self.descriptor = json.loads(line)
        self.descriptor["handle"] = bytes.fromhex(self.descriptor["handle"])

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.close()
            self.proc.wait(30)


# ---- the borrower ---------------------------------------------------------------------------
class Borrower:
    """A borrower pool of 2N + page rows: slots [0, N) hold the prefix it stores, loads go to
    [N, 2N). `engine` is the pool-lease engine on a device lane."""

    def __init__(self, args, dev: Device, mapped, lease_pages):
        from sglang_swift.dataplane import LeasePacking, PoolTransferEngine
        from sglang_swift.dataplane.streams import DeviceLane

        g, _ = geometries(args.emulate)
        self.g, self.dev, self.n = g, dev, args.tokens
        rows = 2 * self.n + g.page_size
        gen = torch.Generator().manual_seed(0)

        def buf(dim):
            raw = torch.randint(0, 255, (rows, g.num_kv_heads, dim * g.itemsize), generator=gen,
                                dtype=torch.uint8)
            return raw.to(dev.torch).view(g.dtype)

        self.k = [buf(g.head_dim) for _ in range(g.num_layers)]
        self.v = [buf(g.v_head_dim) for _ in range(g.num_layers)]
        self.packing = LeasePacking(g, mapped.layout, lease_pages)
        self.engine = PoolTransferEngine(self.packing, mapped.region, self.k, self.v,
                                         liveness=mapped.alive, lane=DeviceLane(dev.lane_device))
        self.src = torch.arange(self.n, device=dev.torch)
        self.dst = torch.arange(self.n, 2 * self.n, device=dev.torch)
        self.blocks = list(range(self.n // g.page_size))
        self.bytes = self.n * g.num_layers * g.num_kv_heads * (g.head_dim + g.v_head_dim) \
            * g.itemsize

    def store(self) -> bool:
        return self.engine.begin_store(self.src, self.blocks, allocator_slots=True).wait(600).ok

    def begin_load(self, counter):
        from sglang_swift.integration.layer_fan_in import BatchLayerCounter

        fan = BatchLayerCounter(counter)
        handle = self.engine.begin_load(self.dst, self.blocks, fan, allocator_slots=True)
        fan.seal()
        return fan, handle

    def wrong_bytes(self) -> int:
        """Bytes of the loaded slots that differ from the stored prefix."""
        wrong = 0
        for bufs in (self.k, self.v):
            for b in bufs:
                a, c = b[self.src].view(torch.uint8), b[self.dst].view(torch.uint8)
                wrong += int((a != c).sum())
        return wrong

    def clear_loaded(self) -> None:
        for b in (*self.k, *self.v):
            b[self.dst] = 0


def _counter(g):
    from sglang_swift.dataplane import LayerCounter
    from sglang_swift.integration.layer_fan_in import TimedLayerCounter

    return TimedLayerCounter(LayerCounter(g.num_layers, timeout_s=60))


def _forward(dev: Device, forward, counter, layers: int, compute) -> None:
    """The forward stand-in on stream `forward`: per layer, attention's wait for the layer
    (SGLang's pool getter), then that layer's compute."""
    with dev.use(forward):
        for layer in range(layers):
            counter.wait_until(layer)
            compute()


def check_ipc_lease(b: Borrower, dev: Device) -> dict:
    ok_store = b.store()
    b.clear_loaded()
    counter = _counter(b.g)
    forward = dev.stream("forward")
    fan, handle = b.begin_load(counter)
    counter.set_consumer(fan.pid)
    _forward(dev, forward, counter, b.g.num_layers, lambda: None)
    dev.synchronize()
    result = handle.wait(600)
    wrong = b.wrong_bytes()
    exchanged = _exchange_both_ways(b)
    return {"ok": ok_store and result.ok and wrong == 0 and not fan.failed_parts()
            and exchanged, "stored": ok_store, "loaded": result.ok, "wrong_bytes": wrong,
            "exchanged": exchanged, "tokens": b.n, "lease_blocks": b.packing.num_blocks}


def _exchange_both_ways(b: Borrower) -> bool:
    """Swap the load slots (filled with a marker byte) with the lease's blocks (the prefix):
    the slots must then hold the prefix; swapped back, the marker again."""
    for buf in (*b.k, *b.v):
        buf.view(torch.uint8)[b.dst] = 0x5A
    first = b.engine.begin_exchange(b.dst, b.blocks, allocator_slots=True).wait(600)
    swapped = first.ok and b.wrong_bytes() == 0
    back = b.engine.begin_exchange(b.dst, b.blocks, allocator_slots=True).wait(600)
    restored = back.ok and all(bool((buf.view(torch.uint8)[b.dst] == 0x5A).all())
                               for buf in (*b.k, *b.v))
    return swapped and restored


def check_kernels(dev: Device) -> dict:
    import swift_kernels as sk

    if dev.emulated and os.environ.get("TRITON_INTERPRET") != "1":
        return {"ok": True, "skipped": "CPU without TRITON_INTERPRET=1"}
    out = {}
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.uint8, torch.float16, torch.float32, torch.float64):
        rows = 64 if dev.emulated else 4096
        src = torch.randint(0, 100, (rows, 24), generator=gen).to(dtype).to(dev.torch)
        src_rows = torch.randperm(rows, generator=gen)[: rows // 2].to(dev.torch)
        dst_rows = torch.randperm(rows, generator=gen)[: rows // 2].to(dev.torch)
        want, got = torch.zeros_like(src), torch.zeros_like(src)
        sk.copy_rows(src, src_rows, want, dst_rows, backend="reference")
        sk.copy_rows(src, src_rows, got, dst_rows, backend="triton")
        out[str(dtype).replace("torch.", "")] = bool(torch.equal(want, got))
    return {"ok": all(out.values()), **out}


def _compute_step(dev: Device, seconds: float):
    """One layer's compute of about `seconds` on the current stream."""
    if dev.emulated:
        return lambda: dev.launch(lambda: time.sleep(seconds))
    a = torch.randn(4096, 4096, device=dev.torch, dtype=torch.bfloat16)
    one = dev.timed(lambda: [a @ a for _ in range(10)]) / 10
    reps = max(1, math.ceil(seconds / one))
    return lambda: [a @ a for _ in range(reps)]


def check_stream(b: Borrower, dev: Device, repeats: int) -> dict:
    forward = dev.stream("forward")
    L = b.g.num_layers

    def load_only():
        counter = _counter(b.g)
        fan, handle = b.begin_load(counter)
        counter.set_consumer(fan.pid)
        _forward(dev, forward, counter, L, lambda: None)
        return handle

    copy_s = min(dev.timed(load_only) for _ in range(repeats))
    step = _compute_step(dev, 1.5 * copy_s / L)  # the forward outlasts the copy: it can hide
    compute_s = min(dev.timed(lambda: _forward(dev, forward, _counter(b.g), L, step))
                    for _ in range(repeats))

    def both():
        counter = _counter(b.g)
        fan, handle = b.begin_load(counter)
        counter.set_consumer(fan.pid)
        _forward(dev, forward, counter, L, step)

    b.clear_loaded()
    both_s = [dev.timed(both) for _ in range(repeats)]
    wrong = b.wrong_bytes()
    hidden = copy_s + compute_s - min(both_s)
    overlap = max(0.0, min(1.0, hidden / copy_s))
    src = torch.empty(b.bytes, dtype=torch.uint8, device=dev.torch)
    dst = torch.empty_like(src)

    def torch_copy():
        if dev.emulated:
            dev.launch(lambda: dst.copy_(src))
        else:
            dst.copy_(src)

    torch_s = min(dev.timed(torch_copy) for _ in range(repeats))
    return {"ok": wrong == 0 and overlap >= 0.5, "overlap_ratio": round(overlap, 3),
            "copy_ms": round(copy_s * 1e3, 3), "forward_ms": round(compute_s * 1e3, 3),
            "both_ms": round(min(both_s) * 1e3, 3), "wrong_bytes": wrong,
            "copy_gbps": round(b.bytes / copy_s / 1e9, 2),
            "torch_copy_gbps": round(b.bytes / torch_s / 1e9, 2),
            "copy_vs_torch_copy": round(torch_s / copy_s, 3), "bytes": b.bytes}


def check_fence(b: Borrower, dev: Device, donor_proc: DonorProcess) -> dict:
    from sglang_swift.dataplane import streams

    forward = dev.stream("forward")
    acked, poisoned = threading.Event(), threading.Event()

    def reclaim():  # the control agent's thread: fence, ack, the donor takes its pages back
        time.sleep(0.05)
        b.engine.fence(range(b.packing.num_blocks))
        acked.set()
        poisoned.set() if donor_proc.ask("poison") == "poisoned" else None

    agent = threading.Thread(target=reclaim)
    agent.start()
    accepted = refused = wrong = after_poison = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        was_poisoned = poisoned.is_set()
        b.clear_loaded()
        counter = _counter(b.g)
        fan, handle = b.begin_load(counter)
        marker = streams.done_marker(b.engine.lane)
        counter.set_consumer(fan.pid)
        _forward(dev, forward, counter, b.g.num_layers, lambda: None)
        streams.wait_marker(marker)
        result = handle.wait(60)
        if result.ok and handle.invalid() is None and not fan.failed_parts():
            accepted += 1
            wrong += b.wrong_bytes()
        else:
            refused += 1
        after_poison += was_poisoned
        if after_poison >= 3:
            break
    agent.join(60)
    return {"ok": wrong == 0 and acked.is_set() and poisoned.is_set() and after_poison >= 3,
            "poisoned_bytes_accepted": wrong, "loads_accepted": accepted,
            "loads_refused": refused, "loads_after_poison": after_poison}


SETTLE_WAIT = ("confirm of a load still copying when its batch settles waits for the copy: "
               "its bytes are judged once it finished, before the output is used; the "
               "forward waited for every layer's copy, so at most until the forward's own "
               "output, which SGLang waits for next")


def check_syncs(b: Borrower, dev: Device) -> dict:
    """The scheduler-thread hooks with host waits made visible (see the module docstring):
    those every step runs must make none; the one exception path is named with its reason."""
    from types import SimpleNamespace

    from sglang_swift.dataplane import streams
    from sglang_swift.integration.copies import InFlightCopy, store_now

    runtime = SimpleNamespace(lease_engine=lambda *key: b.engine, track=lambda *a: None,
                              untrack=lambda *a: None)
    key = ("donor", 1)

    def hook(name, fn, found):
        if dev.emulated:
            with dev.emulated.counting_syncs() as waits:
                out = fn()
            found.extend(f"{name}: {what} at {site}" for what, site in waits)
            return out
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn()
        except RuntimeError as exc:
            found.append(f"{name}: {str(exc).splitlines()[0]}")
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def load(found, slow=False):
        counter = _counter(b.g)
        begun = hook("begin_load+seal", lambda: b.begin_load(counter), found)
        if begun is None:
            return None
        if slow:  # a copy still running at settle (a GPU's is, right after the enqueue)
            with dev.use(b.engine.lane.stream):
                dev.launch(lambda: time.sleep(0.2)) if dev.emulated else None
        return InFlightCopy(key, begun[1], frozenset(b.blocks), b.n,
                            streams.done_marker(b.engine.lane), runtime)

    every_step: list[str] = []
    hook("store_now", lambda: store_now(runtime, key, b.src, b.blocks), every_step)
    copy = load(every_step)
    if copy is not None:
        hook("finished (poll)", copy.finished, every_step)
        dev.synchronize()
        hook("confirm (copy done)", copy.confirm, every_step)
    exception_path: list[str] = []
    copy = load(exception_path, slow=True)
    if copy is not None:
        running = not copy.finished()
        hook("confirm (copy running)", copy.confirm, exception_path)
        if running and not dev.emulated and not exception_path:
            # sync debug mode flags stream, device and copy syncs, not cudaEventSynchronize
            exception_path.append("confirm (copy running): Event.synchronize (an event wait, "
                                  "which set_sync_debug_mode does not flag)")
    dev.synchronize()
    named = [f"{what} [{SETTLE_WAIT}]" for what in exception_path
             if what.startswith("confirm (copy running)")]
    unexpected = every_step + [w for w in exception_path
                               if not w.startswith("confirm (copy running)")]
    return {"ok": not unexpected, "syncs_on_scheduler_path": len(unexpected),
            "syncs_found": unexpected, "syncs_named": named,
            "mode": "emulated device log" if dev.emulated else "set_sync_debug_mode('error')"}


def check_donor_killed(b: Borrower, dev: Device, donor_proc: DonorProcess) -> dict:
    donor_proc.kill()
    time.sleep(0.1)
    accepted = 0
    try:
        for _ in range(3):
            counter = _counter(b.g)
            fan, handle = b.begin_load(counter)
            counter.set_consumer(fan.pid)
            _forward(dev, dev.stream("forward"), counter, b.g.num_layers, lambda: None)
            dev.synchronize()
            result = handle.wait(60)
            accepted += bool(result.ok and handle.invalid() is None)
        crashed = None
    except Exception as exc:  # noqa: BLE001 - reported
        crashed = f"{type(exc).__name__}: {exc}"
    return {"ok": accepted == 0 and crashed is None, "loads_accepted_after_kill": accepted,
            "error": crashed}


def borrower(args) -> int:
    if not args.emulate and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    from sglang_swift.dataplane import LeasePacking, map_pool

    report = Report(args.json_out, args.emulate)
    dev = Device(args.emulate)
    g, dg = geometries(args.emulate)
    need_blocks = args.tokens // g.page_size
    donor_rows = (-(-need_blocks * g.page_bytes // dg.page_bytes) + 4) * dg.page_size
    donors = []
    try:
        d1 = DonorProcess(args, donor_rows)
        donors.append(d1)
        mapped = map_pool(d1.descriptor)
        layout = mapped.layout
        pages = LeasePacking.pages_for(g, layout, need_blocks)
        b = Borrower(args, dev, mapped, list(range(pages)))
        report.part("ipc_lease", check_ipc_lease(b, dev))
        report.part("kernels", check_kernels(dev))
        report.part("stream", check_stream(b, dev, args.repeats))
        report.part("syncs", check_syncs(b, dev))
        b.store()
        report.part("fence", check_fence(b, dev, d1))
        d2 = DonorProcess(args, donor_rows)
        donors.append(d2)
        b2 = Borrower(args, dev, map_pool(d2.descriptor), list(range(pages)))
        b2.store()
        report.part("donor_killed", check_donor_killed(b2, dev, d2))
    except Exception as exc:  # noqa: BLE001 - a crash is a failed check, reported
        report.data["ok"] = False
        report.data["error"] = f"{type(exc).__name__}: {exc}"
        import traceback

        traceback.print_exc()
    finally:
        for d in donors:
            try:
                d.close()
            except Exception:  # noqa: BLE001 - the donor may be gone already
                pass
    parts = report.data["parts"]
    report.data.update({
        "overlap_ratio": parts.get("stream", {}).get("overlap_ratio"),
        "poisoned_bytes_accepted": parts.get("fence", {}).get("poisoned_bytes_accepted"),
        "syncs_on_scheduler_path": parts.get("syncs", {}).get("syncs_on_scheduler_path"),
        "syncs_named": parts.get("syncs", {}).get("syncs_named"),
        "emulated": args.emulate,
    })
    report.write()
    print(json.dumps(report.data, default=str))
    return 0 if report.data["ok"] else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    return donor(args) if args.role == "donor" else borrower(args)


if __name__ == "__main__":
    sys.exit(main())
