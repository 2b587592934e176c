"""`bench_node.py --closed-loop`: the node benchmark's two models under a closed-loop multi-turn
load, as SGLang's `benchmark/hicache/bench_multiturn.py` gives it: `clients` clients, each
`rounds` rounds; a round appends `request_length` new tokens (random token ids, seeded) to the
client's history and asks for `output_length` tokens (greedy, ignore_eos); at most `max_parallel`
requests are in flight, released at `request_rate` per second (exponential gaps, seeded; inf:
no pacing); a client's next round queues behind the others once its answer is back.

Runs, one after another, each with the machine to itself (the donor stays idle: this measures
borrowed memory against local memory, not reclaims):
- `stock`      stock SGLang, the node plan's pools;
- `swiftcache` the busy server borrows what the idle donor lends (the plan's lend fraction);
- `upper_bound` stock SGLang with ONE device pool holding the busy server's pool, the capacity
  the donor lends (`NodePlan.planned_loan`, taken from the donor's pool) and, with
  `--hicache-ratio`, HiCache's host tier too (`upper_bound_pool`): no hierarchy, every token as
  fast to reach as device memory, so no placement of the same memory caches more (for SGLang's
  LRU order); SwiftCache above it is printed with its cause (`upper_bound_exceeded`);
- `upper_bound_twin` the upper bound again: the noise floor of a ratio against it.
The stock run's answers are every later run's histories (forced), so every run sends the same
prompts; `identical` compares each run's answers with stock's, request by request, in token ids
(an answer empty in both is not a match).

`--hicache-ratio R` gives the stock and SwiftCache runs' busy server HiCache's host tier (R x the
base busy pool): stock becomes HiCache, SwiftCache HiCache + SwiftCache; the upper bound's one
pool grows by the same host tokens. `--sweep-clients 4,8,16` runs stock (HiCache with
`--hicache-ratio`), SwiftCache, the upper bound and a twin of stock at each client count and
reports cached tokens and TTFT per system against `history_vs_capacity` (the clients' histories
over the busy server's device pool plus host tier), with `ttft_p99_reduction_vs_stock`
(1 - SwiftCache / stock) beside the twin's `ttft_p99_twin_vs_stock`, the noise floor of that
ratio, and `cached_vs_upper_bound` (SwiftCache / the upper bound).

JSON keys (last line): `closed_loop_ttft_avg_vs_upper_bound`, `closed_loop_ttft_p90_vs_upper_bound`,
`closed_loop_ttft_p99_vs_upper_bound` (swiftcache / upper bound), `closed_loop_ttft_avg_noise`,
`closed_loop_ttft_p99_noise` (upper bound twin / upper bound), `stock_ttft_avg_vs_upper_bound`,
`stock_ttft_p99_vs_upper_bound` (stock / upper bound), `cached_tokens` and `ttft_ms` (avg, p50,
p90, p99) per run, `cached_vs_upper_bound` (swiftcache / upper bound, at most 1 unless
`upper_bound_exceeded` says why), `upper_bound_pool`, `unlimited_cache_tokens` and
`cached_vs_unlimited_cache` (what a cache that never evicts would serve: a bound no size or
eviction order beats; SGLang's LRU over one pool can be beaten by another eviction order once
the histories outgrow it), `history_vs_busy_pool` (the clients'
histories at the end over the busy pool), `identical`, `swift_stats` (the borrower's SwiftCache
counters: donor hits, exchanges, loads), `swift_work_per_request` (the borrower's
scheduler-thread time in SwiftCache's own code over the traffic, ms per request by phase:
`benchmarks/instruments/work.py`), `loadavg`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..instruments.work import breakdown, read_work
from ..loadgen.client import _sse_events
from ..loadgen.stats import pct
from ..tools.demo import wait_for_lease
from ..tools.local_server import start_all
from .observe import parse_metrics
from .plan import ModelFacts, NodePlan, RunSpec, stock_run, swiftcache_run
from .report import same_output
from .runner import bench_server

SWIFT_STATS = ("swiftcache_donor_hit_tokens_total", "swiftcache_exchanged_tokens_total",
               "swiftcache_exchanges_total", "swiftcache_loaded_tokens_total",
               "swiftcache_stored_tokens_total", "swiftcache_loads_failed_total",
               "swiftcache_borrowed_tokens", "swiftcache_layer_wait_seconds_total",
               "swiftcache_evict_wait_seconds_total")


@dataclass(frozen=True)
class ClosedLoop:
    """The load, with SGLang's bench_multiturn.py names."""

    clients: int = 8
    rounds: int = 4
    request_length: int = 48
    output_length: int = 16
    max_parallel: int = 2
    request_rate: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("clients", "rounds", "request_length", "output_length", "max_parallel"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got "
                                 f"{getattr(self, name)}")
        if self.request_rate <= 0:
            raise ValueError(f"--request-rate must be positive (inf: no pacing), got "
                             f"{self.request_rate}")

    def history_tokens(self) -> int:
        return self.clients * self.rounds * (self.request_length + self.output_length)


@dataclass
class Turn:
    client: int
    round: int
    ttft: float | None = None
    cached: int = 0
    prompt: int = 0
    output: tuple = ()
    error: str | None = None


async def _ask(http, url: str, ids: list[int], load: ClosedLoop, turn: Turn) -> None:
    payload = {"input_ids": ids, "stream": True,
               "sampling_params": {"max_new_tokens": load.output_length, "temperature": 0.0,
                                   "ignore_eos": True}}
    start = time.perf_counter()
    out: list[int] = []
    try:
        async with http.post(url + "/generate", json=payload) as resp:
            if resp.status != 200:
                turn.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for now, ev in _sse_events(resp):
                meta = ev.get("meta_info", {})
                got = ev.get("output_ids") or []
                n = meta.get("completion_tokens", 0)
                if got and turn.ttft is None:
                    turn.ttft = now - start
                out = list(got) if len(got) == n else out + list(got)  # cumulative or deltas
                turn.cached = meta.get("cached_tokens", turn.cached) or 0
                turn.prompt = meta.get("prompt_tokens", turn.prompt) or 0
    except Exception as e:  # noqa: BLE001 - a failed request is reported, the run stops
        turn.error = f"{type(e).__name__}: {e}"
    turn.output = tuple(out)


async def drive(url: str, load: ClosedLoop, vocab: int, forced: dict | None) -> list[Turn]:
    """One closed-loop run against `url`; `forced[(client, round)]`: the answers to put in the
    histories (None: each run's own)."""
    import aiohttp

    rng = random.Random(load.seed)
    new = {(c, r): [rng.randrange(16, vocab - 16) for _ in range(load.request_length)]
           for c in range(load.clients) for r in range(load.rounds)}
    gaps = random.Random(load.seed + 1)
    history: list[list[int]] = [[] for _ in range(load.clients)]
    queue: asyncio.Queue = asyncio.Queue()
    for c in range(load.clients):
        queue.put_nowait((c, 0))
    turns: list[Turn] = []
    slots = asyncio.Semaphore(load.max_parallel)
    pending = load.clients * load.rounds
    done = asyncio.Event()

    async def one(http, c: int, r: int) -> None:
        nonlocal pending
        try:
            ids = history[c] + new[(c, r)]
            turn = Turn(c, r)
            await _ask(http, url, ids, load, turn)
            turns.append(turn)
            if turn.error:
                raise RuntimeError(f"client {c} round {r + 1}: {turn.error}")
            answer = list(forced[(c, r)]) if forced is not None else list(turn.output)
            history[c] = ids + answer
            if r + 1 < load.rounds:
                queue.put_nowait((c, r + 1))
        finally:
            slots.release()
            pending -= 1
            if pending == 0:
                done.set()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        tasks = []
        while pending and not done.is_set():
            await slots.acquire()
            get = asyncio.ensure_future(queue.get())
            finished = asyncio.ensure_future(done.wait())
            await asyncio.wait({get, finished}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                slots.release()
                break
            finished.cancel()
            c, r = get.result()
            tasks.append(asyncio.ensure_future(one(http, c, r)))
            if load.request_rate != float("inf"):
                await asyncio.sleep(gaps.expovariate(load.request_rate))  # the pacing itself
        results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [e for e in results if isinstance(e, BaseException)]
    if errors:
        raise errors[0]
    return turns


def _metrics(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode(errors="replace"), SWIFT_STATS)


def hicache_args(ratio: float) -> list[str]:
    """HiCache on a busy server, host memory `ratio` x its pool (none where `ratio` is 0)."""
    if not ratio:
        return []
    return ["--enable-hierarchical-cache", "--hicache-ratio", f"{ratio:.6f}",
            "--hicache-write-policy", "write_back", "--hicache-mem-layout", "layer_first"]


def host_pool_tokens(plan: NodePlan, ratio: float) -> int:
    """HiCache's host pool on the base busy pool as SGLang 0.5.23 sizes it (`pool_host/base.py`:
    the ratio times the device tokens, plus its padding page of one token on CPU); 0 without."""
    return int(plan.busy_pool * ratio) + 1 if ratio else 0


def upper_bound_run(plan: NodePlan, loan: int, lent: int, host_tokens: int) -> RunSpec:
    """Stock SGLang, one device pool: the busy pool, the `loan` (busy tokens) the donor lends
    (its pool shrinks by `lent`, its tokens) and `host_tokens`; no hierarchy."""
    if loan < 0 or host_tokens < 0 or not 0 <= lent < plan.donor_pool:
        raise ValueError(f"upper bound out of range: loan {loan}, lent {lent} of "
                         f"{plan.donor_pool}, host {host_tokens}")
    return RunSpec("u", "upper_bound", plan.busy_pool + loan + host_tokens,
                   plan.donor_pool - lent, swiftcache=False)


def run_one(spec: RunSpec, plan: NodePlan, load: ClosedLoop, busy_model: Path,
            donor_model: Path, out: Path, forced: dict | None, max_borrow_blocks: int,
            vocab: int, hicache_ratio: float = 0.0) -> dict:
    rendezvous = str((out / f"rendezvous-{spec.name}").resolve())
    host = hicache_args(hicache_ratio) if spec.name in ("stock", "swiftcache") else []
    busy = bench_server(busy_model, spec, "busy", spec.busy_pool,
                        spec.busy_args(plan, rendezvous, max_borrow_blocks) + host, plan, out,
                        False)
    donor = bench_server(donor_model, spec, "donor", spec.donor_pool,
                         spec.donor_args(plan, rendezvous), plan, out, False)
    before = os.getloadavg()
    try:
        start_all([busy, donor])
        if spec.swiftcache:
            wait_for_lease(rendezvous, timeout_s=180)
        work_before = read_work(busy.base_url, settle=True) if spec.swiftcache else None
        t0 = time.monotonic()
        turns = asyncio.run(drive(busy.base_url, load, vocab, forced))
        wall = time.monotonic() - t0
        stats = _metrics(busy.base_url) if spec.swiftcache else {}
        work = breakdown(work_before, read_work(busy.base_url, settle=True), len(turns),
                         "request") if spec.swiftcache else None
    finally:
        busy.stop()
        donor.stop()
    return {"turns": turns, "wall_s": round(wall, 1), "stats": stats, "work": work,
            "loadavg": [round(x, 2) for x in before + os.getloadavg()]}


def upper_bound_exceeded(swift: int, bound: int) -> dict | None:
    """Why SwiftCache cached more than the upper bound, or None where it did not."""
    if swift <= bound:
        return None
    return {"by_tokens": swift - bound,
            "why": "both runs send the same prompts (forced histories), but a closed loop's "
                   "order of requests follows each answer's timing: a different interleaving "
                   "(nondeterminism), a different eviction order (SGLang's LRU over one pool is "
                   "no optimum), or an over-count of cached tokens (a bug)"}


def unlimited_cache_tokens(turns: list, load: ClosedLoop) -> int:
    """What a cache that never evicts would serve from cache over these turns: each round's
    prompt begins with the client's previous prompt and its answer, whose KV was computed (the
    answer's last token's was not; counted all the same), and nothing else of it was seen
    before (new tokens are random per client and round). No cache of any size, placement or
    eviction order serves more, so SwiftCache above it is a miscount."""
    prompt = {(t.client, t.round): t.prompt for t in turns}
    return sum(prompt[(t.client, t.round - 1)] + load.output_length for t in turns
               if t.round > 0 and (t.client, t.round - 1) in prompt)


def summarize(runs: dict, plan: NodePlan, load: ClosedLoop, pools: dict) -> dict:
    ref = {(t.client, t.round): t.output for t in runs["stock"]["turns"]}
    out: dict = {"load": asdict(load), "pools": pools, "cached_tokens": {}, "ttft_ms": {},
                 "mismatches": {}, "wall_s": {}, "loadavg": {}}
    for name, run in runs.items():
        ttft = [t.ttft * 1e3 for t in run["turns"] if t.ttft is not None]
        out["cached_tokens"][name] = sum(t.cached for t in run["turns"])
        out["ttft_ms"][name] = {"avg": sum(ttft) / len(ttft) if ttft else None,
                                "p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)}
        out["mismatches"][name] = sum(1 for t in run["turns"]
                                      if not same_output(t.output, ref[(t.client, t.round)]))
        out["wall_s"][name] = run["wall_s"]
        out["loadavg"][name] = run["loadavg"]
    out["prompt_tokens"] = sum(t.prompt for t in runs["stock"]["turns"])
    t, s, u, w = (out["ttft_ms"].get(k) for k in ("stock", "swiftcache", "upper_bound",
                                                  "upper_bound_twin"))

    def ratio(a, b, q):
        return None if a is None or b is None or not b[q] else a[q] / b[q]

    out["closed_loop_ttft_avg_vs_upper_bound"] = ratio(s, u, "avg")
    out["closed_loop_ttft_p99_vs_upper_bound"] = ratio(s, u, "p99")
    out["closed_loop_ttft_p90_vs_upper_bound"] = ratio(s, u, "p90")
    out["closed_loop_ttft_avg_noise"] = ratio(w, u, "avg")
    out["closed_loop_ttft_p99_noise"] = ratio(w, u, "p99")
    out["stock_ttft_avg_vs_upper_bound"] = ratio(t, u, "avg")
    out["stock_ttft_p99_vs_upper_bound"] = ratio(t, u, "p99")
    cached = out["cached_tokens"]
    bound = cached["upper_bound"]
    out["cached_vs_upper_bound"] = cached["swiftcache"] / bound if bound else None
    out["upper_bound_exceeded"] = upper_bound_exceeded(cached["swiftcache"], bound)
    out["upper_bound_pool"] = pools["upper_bound"]["busy"]
    unlimited = unlimited_cache_tokens(runs["stock"]["turns"], load)
    out["unlimited_cache_tokens"] = unlimited
    out["cached_vs_unlimited_cache"] = cached["swiftcache"] / unlimited if unlimited else None
    out["history_vs_busy_pool"] = round(load.history_tokens() / plan.busy_pool, 2)
    out["identical"] = out["mismatches"]["swiftcache"] == 0
    out["swift_stats"] = runs["swiftcache"]["stats"]
    out["swift_work_per_request"] = runs["swiftcache"].get("work")
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("closed loop (--closed-loop)")
    g.add_argument("--closed-loop", action="store_true",
                   help="the closed-loop multi-turn mode (this module's docstring)")
    d = ClosedLoop()
    g.add_argument("--num-clients", type=int, default=d.clients)
    g.add_argument("--num-rounds", type=int, default=d.rounds)
    g.add_argument("--request-length", type=int, default=d.request_length)
    g.add_argument("--output-length", type=int, default=d.output_length)
    g.add_argument("--max-parallel", type=int, default=d.max_parallel)
    g.add_argument("--request-rate", type=float, default=d.request_rate)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--hicache-ratio", type=float, default=0.0,
                   help="every run's busy server with HiCache, host memory this many times the "
                        "base busy pool (write_back; the upper bound's one pool grows by as many "
                        "tokens); 0: no HiCache (default)")
    g.add_argument("--sweep-clients", default=None,
                   help="comma-separated client counts: stock (or HiCache), SwiftCache, the "
                        "upper bound and a twin of stock at each; the JSON gets `sweep`, one "
                        "entry per count")


def main(args: argparse.Namespace, plan: NodePlan, out: Path, max_borrow_blocks: int) -> int:
    from ..tools.tiny_model import ensure_tiny_model

    load = ClosedLoop(args.num_clients, args.num_rounds, args.request_length,
                      args.output_length, args.max_parallel, args.request_rate, args.seed)
    busy_model, donor_model = ensure_tiny_model(shape="small"), ensure_tiny_model(shape="tiny")
    busy, donor = ModelFacts.from_dir(busy_model), ModelFacts.from_dir(donor_model)
    vocab = json.loads((busy_model / "config.json").read_text())["vocab_size"]
    loan, lent = plan.planned_loan(busy, donor)
    bound = upper_bound_run(plan, loan, lent, host_pool_tokens(plan, args.hicache_ratio))
    specs = {"stock": stock_run(plan), "swiftcache": swiftcache_run(plan), "upper_bound": bound,
             "upper_bound_twin": bound}
    print(f"busy: {busy.describe()}\nload: {asdict(load)}; histories {load.history_tokens()} "
          f"tokens, busy pool {plan.busy_pool}, upper bound's one pool {bound.busy_pool}",
          flush=True)
    out.mkdir(parents=True, exist_ok=True)
    if args.sweep_clients:
        return _sweep(args, plan, load, specs, busy_model, donor_model, out, max_borrow_blocks,
                      vocab)
    runs: dict = {}
    forced = None
    for name, spec in specs.items():
        runs[name] = run_one(spec, plan, load, busy_model, donor_model, out, forced,
                             max_borrow_blocks, vocab, args.hicache_ratio)
        if name == "stock":
            forced = {(t.client, t.round): t.output for t in runs[name]["turns"]}
        tt = [t.ttft for t in runs[name]["turns"] if t.ttft is not None]
        print(f"[{name}] {len(tt)} requests in {runs[name]['wall_s']}s, cached "
              f"{sum(t.cached for t in runs[name]['turns'])} tokens, mean TTFT "
              f"{1e3 * sum(tt) / len(tt):.1f} ms", flush=True)
    pools = {name: {"busy": s.busy_pool, "donor": s.donor_pool} for name, s in specs.items()}
    summary = summarize(runs, plan, load, pools)
    summary["hicache_ratio"] = args.hicache_ratio
    _warn_above_bound(summary["upper_bound_exceeded"])
    if plan.busy_tp > 1:
        summary["busy_tp"] = plan.busy_tp
    (out / "closed_loop.json").write_text(json.dumps(
        {"summary": summary, "turns": {n: [asdict(t) for t in r["turns"]]
                                       for n, r in runs.items()}}, indent=1))
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0


def _sweep(args, plan: NodePlan, base: ClosedLoop, specs: dict, busy_model: Path,
           donor_model: Path, out: Path, max_borrow_blocks: int, vocab: int) -> int:
    """The three systems and stock's twin at each client count: cached tokens and TTFT per
    system, and the clients' histories against the busy server's own capacity (device pool plus
    host tier)."""
    from dataclasses import replace

    try:
        counts = [int(x) for x in args.sweep_clients.split(",") if x]
    except ValueError:
        raise SystemExit(f"--sweep-clients takes comma-separated integers, got "
                         f"{args.sweep_clients!r}") from None
    capacity = plan.busy_pool * (1 + args.hicache_ratio)
    points = []
    for n in counts:
        load = replace(base, clients=n)
        runs: dict = {}
        forced = None
        for name in ("stock", "swiftcache", "upper_bound", "stock_twin"):
            spec = specs["stock" if name == "stock_twin" else name]
            runs[name] = run_one(spec, plan, load, busy_model, donor_model, out, forced,
                                 max_borrow_blocks, vocab, args.hicache_ratio)
            if name == "stock":
                forced = {(t.client, t.round): t.output for t in runs[name]["turns"]}
        ref = forced
        point = {"clients": n, "history_vs_capacity": round(load.history_tokens() / capacity, 2),
                 "cached_tokens": {}, "ttft_avg_ms": {}, "ttft_p99_ms": {}, "mismatches": {}}
        for name, run in runs.items():
            ttft = [t.ttft * 1e3 for t in run["turns"] if t.ttft is not None]
            point["cached_tokens"][name] = sum(t.cached for t in run["turns"])
            point["ttft_avg_ms"][name] = sum(ttft) / len(ttft)
            point["ttft_p99_ms"][name] = pct(ttft, 99)
            point["mismatches"][name] = sum(
                1 for t in run["turns"] if not same_output(t.output, ref[(t.client, t.round)]))
        p99, avg = point["ttft_p99_ms"], point["ttft_avg_ms"]
        point["ttft_p99_reduction_vs_stock"] = 1 - p99["swiftcache"] / p99["stock"]
        point["ttft_p99_twin_vs_stock"] = p99["stock_twin"] / p99["stock"]
        point["ttft_avg_twin_vs_stock"] = avg["stock_twin"] / avg["stock"]
        cached = point["cached_tokens"]
        point["cached_vs_stock"] = cached["swiftcache"] / max(1, cached["stock"])
        point["cached_vs_upper_bound"] = (cached["swiftcache"] / cached["upper_bound"]
                                          if cached["upper_bound"] else None)
        point["upper_bound_exceeded"] = upper_bound_exceeded(cached["swiftcache"],
                                                             cached["upper_bound"])
        _warn_above_bound(point["upper_bound_exceeded"])
        unlimited = unlimited_cache_tokens(runs["stock"]["turns"], load)
        point["cached_vs_unlimited_cache"] = (cached["swiftcache"] / unlimited
                                              if unlimited else None)
        point["loadavg"] = {name: run["loadavg"] for name, run in runs.items()}
        points.append(point)
        print(f"[{n} clients] {json.dumps(point)}", flush=True)
    summary = {"sweep": points, "hicache_ratio": args.hicache_ratio, "load": asdict(base),
               "capacity_tokens": capacity,
               "identical": all(p["mismatches"]["swiftcache"] == 0 for p in points)}
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0


def _warn_above_bound(over: dict | None) -> None:
    if over is not None:
        print(f"WARNING: SwiftCache cached {over['by_tokens']} tokens more than the upper bound: "
              f"{over['why']}", flush=True)
