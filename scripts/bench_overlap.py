#!/usr/bin/env python3
"""Overlap of donor loads with the forward pass, measured in live CPU servers.

A borrower runs the `small` Llama (8 layers, 22.6 M parameters, 8 KiB of fp32 KV per token,
about 5.5 kFLOP of prefill per KV byte: not toy-sized) with a KV pool that holds about two of
the benchmark's prefixes; a donor (the `tiny` model: another shape) lends it pages of its own
pool. In one run it measures:
- TTFT of the same prefix (`--prefix-tokens`, 1536; 1024 quick) served as a miss (recompute), as a
  local device hit, and as a donor hit (pushed out of the pool by later prefixes, so its
  demotion stored it in the donor's pages);
- the scheduler thread's time spent waiting on copies per load (the borrower's load trace,
  `SWIFTCACHE_LOAD_TRACE`, `benchmarks.instruments`: waits on a load copy or on a store an
  eviction needed, between the load's admission and the end of its forward), and the time
  attention waited for its layer;
- inter-token latency of a decode running while other requests arrive, once with local hits
  and once with donor hits;
- one load's per-layer timeline (when each layer was in place against when attention reached
  it), plotted to `--plot`.

The last line printed is a JSON object with `stall_ms_p99`, `donor_vs_local_ttft`,
`donor_vs_recompute_ttft` and `decode_itl_p99_ratio` (donor hits / local hits). `--quick` runs
in a few minutes here. docs/streaming.md explains the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.instruments import instruments_env  # noqa: E402
from benchmarks.tools.demo import wait_for_lease  # noqa: E402
from benchmarks.tools.local_server import LocalServer  # noqa: E402
from benchmarks.tools.tiny_model import MODEL_SHAPES, ensure_tiny_model  # noqa: E402

SHAPE = MODEL_SHAPES["small"]
# fp32 K and V of every layer: 2 x layers x KV heads x head dim x 4 bytes (8 KiB)
KV_BYTES_PER_TOKEN = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * \
    SHAPE["head_dim"] * 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a few minutes)")
    p.add_argument("--prefix-tokens", type=int, default=None, help="default 1536; quick 1024")
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=None, help="TTFT triples (default 6; quick 3)")
    p.add_argument("--decode-tokens", type=int, default=None, help="default 192; quick 96")
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "streaming_timeline.png"))
    p.add_argument("--workdir", default=None, help="logs and the load trace (default: a temp dir)")
    return p.parse_args(argv)


def pct(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def flop_per_kv_byte(shape: dict) -> float:
    """Prefill FLOPs per byte of fp32 KV written, per token: 2 x (matmul weights), attention
    projections and MLP, over 2 x layers x kv_heads x head_dim x 4 bytes."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inter
    flops = 2 * (layers * per_layer + h * shape["vocab_size"])
    return flops / (2 * layers * kv * d * 4)


class Client:
    def __init__(self, server: LocalServer, vocab: int, seed: int = 0):
        self.server, self.vocab, self.rng = server, vocab, random.Random(seed)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab) for _ in range(n)]

    def ttft_ms(self, ids: list[int]) -> float:
        """Latency of a one-token generation: queueing, prefill and the first token."""
        start = time.perf_counter()
        self.server.post("/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": 1, "temperature": 0.0}})
        return (time.perf_counter() - start) * 1e3

    def stream_gaps_ms(self, ids: list[int], n: int, started: threading.Event) -> list[float]:
        """Inter-token gaps of a streamed greedy generation of `n` tokens."""
        body = json.dumps({"input_ids": ids, "stream": True, "sampling_params": {
            "max_new_tokens": n, "min_new_tokens": n, "temperature": 0.0}}).encode()
        req = urllib.request.Request(self.server.base_url + "/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        stamps = []
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data:") and b"[DONE]" not in line:
                    stamps.append(time.perf_counter())
                    if len(stamps) == 2:
                        started.set()
        started.set()
        return [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:])]  # from the 2nd token


def metric(server: LocalServer, name: str) -> float:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def read_trace(path: Path, skip: int = 0) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines()[skip:] if x.strip()]


def unhidden_ms(record: dict) -> float:
    """How long attention waited for its layers in one load: per layer, how much later the
    copy was in place than attention asked for it."""
    return sum(max(0.0, ready - reached) for ready, reached in
               zip(record["ready_ms"], record["reached_ms"])
               if ready is not None and reached is not None)


def ttft_phase(c: Client, args) -> dict:
    """Rounds of a miss, a local hit and a donor hit back to back (so each kind sees the same
    machine): the pool holds about two prefixes, so the prefix computed two rounds earlier has
    been demoted into the donor's pages by the time its donor hit comes."""
    prefixes = [c.tokens(args.prefix_tokens) for _ in range(args.repeats + 2)]
    out: dict[str, list[float]] = {"miss": [], "local": [], "donor": []}
    for i, p in enumerate(prefixes):
        out["miss"].append(c.ttft_ms(p + c.tokens(args.suffix_tokens)))
        out["local"].append(c.ttft_ms(p + c.tokens(args.suffix_tokens)))
        if i >= 2:
            out["donor"].append(c.ttft_ms(prefixes[i - 2] + c.tokens(args.suffix_tokens)))
    return out


def itl_phase(c: Client, args, kind: str) -> list[float]:
    """A decode streams while 4 requests arrive on 512-token prefixes that are local hits
    (computed just before) or donor hits (computed, then pushed out of the pool by 3 fillers of
    `--prefix-tokens`, more than the pool holds)."""
    prefixes = [c.tokens(512) for _ in range(4)]
    for p in prefixes:
        c.ttft_ms(p + c.tokens(8))
    if kind == "donor":
        for _ in range(3):
            c.ttft_ms(c.tokens(args.prefix_tokens))
        time.sleep(1.0)
    started = threading.Event()
    gaps: list[float] = []
    t = threading.Thread(target=lambda: gaps.extend(
        c.stream_gaps_ms(c.tokens(64), args.decode_tokens, started)))
    t.start()
    started.wait(120)
    for p in prefixes:
        c.ttft_ms(p + c.tokens(args.suffix_tokens))
    t.join(600)
    return gaps


def plot_timeline(record: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = range(len(record["ready_ms"]))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(layers, record["ready_ms"], "o-", label="layer's copy in place (counter released)")
    ax.plot(layers, record["reached_ms"], "s--", label="attention asks for the layer")
    ax.set_xlabel("layer")
    ax.set_ylabel("ms since the batch's loads started")
    mib = record["tokens"] * KV_BYTES_PER_TOKEN / 2**20
    ax.set_title(f"One donor load under its forward: {record['tokens']} tokens, "
                 f"{mib:.1f} MiB of KV in {len(record['ready_ms'])} layers", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.prefix_tokens = args.prefix_tokens or (1024 if args.quick else 1536)
    args.repeats = args.repeats or (3 if args.quick else 6)
    args.decode_tokens = args.decode_tokens or (96 if args.quick else 192)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_overlap_"))
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "loads.jsonl"
    trace.unlink(missing_ok=True)
    small, tiny = ensure_tiny_model(shape="small"), ensure_tiny_model(shape="tiny")
    shape = SHAPE
    pool = 2 * (args.prefix_tokens + args.suffix_tokens) + 1024  # two prefixes and a margin
    rv = str(work / "rv")
    common = ["--dtype", "float32", "--swiftcache-rendezvous-dir", rv,
              "--swiftcache-heartbeat-timeout-s", "3", "--swiftcache-heartbeat-interval-s", "0.3"]
    env = instruments_env(load_trace=str(trace))
    # the donor lends enough pages for every prefix of the run (16384 borrower blocks): nothing
    # is dropped from the donor tier, so each donor hit is one
    donor = LocalServer(tiny, max_total_tokens=131072, log_path=work / "donor.log",
                        extra_args=[*common, "--swiftcache-role", "donor",
                                    "--swiftcache-lend-fraction", "0.5"])
    borrower = LocalServer(small, max_total_tokens=pool, log_path=work / "borrower.log", env=env,
                           extra_args=[*common, "--swiftcache-role", "borrower", "--enable-metrics",
                                       "--swiftcache-max-borrow-blocks", "16384"])
    t0 = time.monotonic()
    with donor, borrower:
        wait_for_lease(rv, timeout_s=120)
        c = Client(borrower, shape["vocab_size"])
        c.ttft_ms(c.tokens(64))  # warm-up
        ttft = ttft_phase(c, args)
        ttft_loads = read_trace(trace)
        itl_local = itl_phase(c, args, "local")
        skip = len(read_trace(trace))
        itl_donor = itl_phase(c, args, "donor")
        itl_loads = read_trace(trace, skip)
        totals = {k: metric(borrower, f"swiftcache_{k}") for k in (
            "loads_started_total", "loads_failed_total", "load_retries_total",
            "loads_declined_total", "hits_unreadable_total",
            "load_wait_seconds_total", "evict_wait_seconds_total", "evict_waits_total",
            "layer_wait_seconds_total", "stores_started_total")}
    loads = [r for r in ttft_loads + itl_loads if r["ok"]]
    stalls = [r["scheduler_wait_ms"] for r in loads]
    layer_waits = [unhidden_ms(r) for r in loads]
    big = [r for r in ttft_loads if r["ok"] and r["tokens"] >= args.prefix_tokens]
    if big:
        plot_timeline(big[len(big) // 2], Path(args.plot))
    med = {k: statistics.median(v) for k, v in ttft.items()}
    result = {
        "model": "small-llama (22.6 M, fp32)", "flop_per_kv_byte": round(flop_per_kv_byte(shape)),
        "prefix_tokens": args.prefix_tokens, "borrower_pool_tokens": pool,
        "loads": len(loads), "itl_donor_phase_loads": sum(r["requests"] for r in itl_loads),
        "stall_ms_p50": round(pct(stalls, 50), 3),
        "stall_ms_p99": round(pct(stalls, 99), 3),
        "attention_wait_ms_p50": round(pct(layer_waits, 50), 2),
        "attention_wait_ms_p99": round(pct(layer_waits, 99), 2),
        "ttft_ms": {k: round(v, 1) for k, v in med.items()},
        "donor_vs_local_ttft": round(med["donor"] / med["local"], 3),
        "donor_vs_recompute_ttft": round(med["donor"] / med["miss"], 3),
        "itl_ms_p99": {"local_hits": round(pct(itl_local, 99), 1),
                       "donor_hits": round(pct(itl_donor, 99), 1)},
        "decode_itl_p99_ratio": round(pct(itl_donor, 99) / pct(itl_local, 99), 3),
        "counters": {k: round(v, 4) for k, v in totals.items()},
        "timeline": big[len(big) // 2] if big else None,
        "wall_s": round(time.monotonic() - t0, 1), "workdir": str(work),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
