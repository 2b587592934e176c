"""`scripts/bench_multiturn.py`: SGLang's bench_multiturn.py traffic (`multiturn.py`) against
stock SGLang, a SwiftCache borrower and the ideal, with every request's phases (`phases.py`).

Servers (the busy model `small`, all up for the whole benchmark, started side by side):
- `stock`       stock SGLang, a `--busy-pool`-token pool;
- `swiftcache`  a borrower with the same pool, and its donor (`tiny`, `--donor-pool` tokens,
  lending `--lend-fraction` of them: `NodePlan.planned_loan` busy tokens), which serves nothing;
- `swiftcache_stream`  SwiftCache streaming layers from donor pages (`--swiftcache-layer-stream
  donor`, resident fraction `--stream-resident-fraction`) with the stock pool's local KV memory
  (`stream_plan`), and its own donor lending the store's streamed pages (about the same loan);
- `swiftcache_mapped`  SwiftCache reading donor pages in place (`--swiftcache-layer-stream donor
  --swiftcache-layer-stream-depth 0`): local rows at most the stock pool's, the rest of a pool of
  the stock pool plus the loan mapped from its own donor's pages (`mapped_plan`);
- `ideal`       stock SGLang whose one pool holds the busy pool and the loan;
- `ideal_twin`  the ideal again: the noise floor of a ratio against the ideal.
`--modes` leaves out any SwiftCache server. For every client count and seed the servers take
turns (the order rotated by one each time), each
after a `/flush_cache` and a second's pause (as the original between rates). Every busy server
writes its forward passes and the borrower its batch loads to OUT (the debug seam's traces), so
each request gets a timeline (`phases.timeline`).

Per client count, the last line's JSON has, as means over the seeds and for the worst seed:
`ttft_p99_vs_stock` (SwiftCache's TTFT P99 / stock's), `ttft_avg_vs_ideal`, `ttft_p99_vs_ideal`
(SwiftCache / the ideal), `twin_ttft_avg_vs_ideal`, `twin_ttft_p99_vs_ideal` (the twin / the
ideal), their spreads over the seeds (max - min) and each seed's value (`per_seed`), and
`slowest_phase_p99` (SwiftCache's sequential phase with the largest P99, beside stock's P99
of it) and `phase_p99_excess_vs_stock` (the phase whose P99 exceeds stock's by the most), and
`ttft_gap_split` (`gap_split`: its mean TTFT minus the ideal's, split into what its uncached
prompt tokens cost at the ideal's speed, its longer wait for admission, and the rest; means
over the seeds). The same keys prefixed `stream_` are those of `swiftcache_stream`, prefixed
`mapped_` those of `swiftcache_mapped`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..instruments import instruments_env
from ..instruments.work import breakdown, read_work
from ..layer_stream.context_servers import MAPPED_PLACED, donor_reads, wait_store_on_donor
from ..loadgen.stats import pct
from ..tools.demo import wait_for_lease
from ..tools.local_server import start_all
from . import phases
from .closed_loop import SWIFT_STATS
from .multiturn import Prompts, Workload, drive
from .observe import parse_metrics
from .plan import COMMON_ARGS, HEARTBEAT_ARGS, ModelFacts, NodePlan, RunSpec
from .runner import bench_server

SYSTEMS = ("stock", "swiftcache", "swiftcache_stream", "swiftcache_mapped", "ideal", "ideal_twin")
MODES = ("swiftcache", "swiftcache_stream", "swiftcache_mapped")
PREFIX = {"swiftcache": "", "swiftcache_stream": "stream_", "swiftcache_mapped": "mapped_"}
DEFAULT_MODES = MODES
SWIFT_RATIOS = ("ttft_p99_vs_stock", "ttft_avg_vs_ideal", "ttft_p99_vs_ideal")
TWIN_RATIOS = ("twin_ttft_avg_vs_ideal", "twin_ttft_p99_vs_ideal")
STREAM_DEPTH = 2
STREAM_STATS = ("stream_rows_loaded", "stream_rows_from_donor", "stream_rows_saved")


@dataclass(frozen=True)
class StreamPlan:
    """`swiftcache_stream`'s pool: the largest whose local KV memory (resident rows of every
    layer, STREAM_DEPTH staging layers for the rest) is at most the stock pool's, and a donor
    that lends every streamed page of its store."""

    tokens: int  # --max-total-tokens
    resident: int  # resident slots (every layer local)
    streamed: int  # streamed slots: store pages placed on the donor (one-token pages)
    donor_pool: int  # the donor's pool: its lend fraction of it holds the streamed pages


def stream_plan(plan: NodePlan, busy: ModelFacts, donor: ModelFacts,
                fraction: float) -> StreamPlan:
    from ..layer_stream.context_bench import Setup
    from ..layer_stream.context_resident import ResidentPlan

    setup = Setup(pool=plan.busy_pool, layers=busy.layers, depth=STREAM_DEPTH, out_tokens=0,
                  chunk=0, decode_steps=0, repeats=0)
    row = busy.kv_bytes_per_token // (2 * busy.layers)  # one layer's K row of one token
    rp = ResidentPlan.fit(setup, fraction, row)
    streamed = rp.tokens + 1 - rp.resident
    need = -(-streamed * busy.kv_bytes_per_token // donor.kv_bytes_per_token)
    if plan.lent_donor_tokens < int(plan.donor_pool * plan.lend_fraction):
        raise ValueError("the stream donor is sized by its lend fraction; the reclaim "
                         f"watermark {plan.reclaim_watermark} leaves it less")
    return StreamPlan(rp.tokens, rp.resident, streamed, int(need / plan.lend_fraction) + 64)


@dataclass(frozen=True)
class MappedPlan:
    """`swiftcache_mapped`'s pool: `local` rows of every layer (whole mapping units, at most the
    stock pool's tokens) and `mapped` rows read in place (whole pieces, at most the loan), as
    `tokens` slots (one padding row); its donor lends every piece's chunk."""

    tokens: int  # --max-total-tokens
    local: int
    mapped: int
    fraction: float  # --swiftcache-layer-stream-resident-fraction: local / tokens
    donor_pool: int


def mapped_plan(plan: NodePlan, busy: ModelFacts, donor: ModelFacts, loan: int) -> MappedPlan:
    from sglang_swift.layer_stream.mapped import PIECE_BYTES, piece_bytes_for

    row = busy.kv_bytes_per_token // (2 * busy.layers)
    unit = 4096 // math.gcd(4096, row)
    per = piece_bytes_for(row) // row
    local = plan.busy_pool // unit * unit
    mapped = loan // per * per
    tokens = local + mapped - 1
    donor_row = donor.kv_bytes_per_token // (2 * donor.layers)
    pages = -(-mapped * busy.kv_bytes_per_token // donor.kv_bytes_per_token)
    pages += -(-PIECE_BYTES // donor_row) + 1  # the alignment a run of pages may lose
    return MappedPlan(tokens, local, mapped, (local + 0.5) / tokens,
                      int(pages / plan.lend_fraction) + 64)


def specs(plan: NodePlan, loan: int, lent: int, stream: StreamPlan,
          mapped: MappedPlan) -> dict[str, RunSpec]:
    ideal = plan.busy_pool + loan
    return {"stock": RunSpec("a", "stock", plan.busy_pool, plan.donor_pool, False),
            "swiftcache": RunSpec("b", "swiftcache", plan.busy_pool, plan.donor_pool, True),
            "swiftcache_stream": RunSpec("s", "swiftcache_stream", stream.tokens,
                                         stream.donor_pool, True),
            "swiftcache_mapped": RunSpec("m", "swiftcache_mapped", mapped.tokens,
                                         mapped.donor_pool, True),
            "ideal": RunSpec("c", "ideal", ideal, plan.donor_pool - lent, False),
            "ideal_twin": RunSpec("t", "ideal_twin", ideal, plan.donor_pool - lent, False)}


def stream_args(rendezvous: str, fraction: float, depth: int = STREAM_DEPTH) -> list[str]:
    return [*COMMON_ARGS, *HEARTBEAT_ARGS, "--swiftcache-rendezvous-dir", rendezvous,
            "--swiftcache-layer-stream", "donor",
            "--swiftcache-layer-stream-depth", str(depth),
            "--swiftcache-layer-stream-resident-fraction", str(fraction)]


def _read_lines(path: Path, start: int) -> tuple[list[dict], int]:
    """JSON lines of `path` from byte `start`; and the new end."""
    if not path.exists():
        return [], start
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    lines = [json.loads(x) for x in data.decode().splitlines() if x.strip()]
    return lines, start + len(data)


def _post(url: str, path: str) -> None:
    req = urllib.request.Request(url + path, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def _swift_stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode(errors="replace"), SWIFT_STATS)


QUIET_LOAD_PER_CPU = 0.75  # a 1-minute load average below this per CPU counts as quiet
QUIET_WAIT_S = 240.0


def wait_until_quiet(limit: float | None = None, max_s: float = QUIET_WAIT_S,
                     loadavg=os.getloadavg, sleep=time.sleep, clock=time.monotonic) -> float:
    """Wait until the machine's 1-minute load average is below `limit` (default
    QUIET_LOAD_PER_CPU per CPU), at most `max_s` seconds: starting seven servers loads two
    cores for a minute or more, and the runs right after would measure that. Returns the load
    it stopped at (printed, with the wait)."""
    limit = limit if limit is not None else QUIET_LOAD_PER_CPU * (os.cpu_count() or 1)
    t0 = clock()
    while loadavg()[0] >= limit and clock() - t0 < max_s:
        sleep(2.0)
    load = loadavg()[0]
    print(f"settled {clock() - t0:.0f} s after start-up: load average {load:.2f} "
          f"(quiet below {limit:.2f})", flush=True)
    return load


class Bench:
    """The servers, their trace files and what each run read from them."""

    def __init__(self, plan: NodePlan, busy_model: Path, donor_model: Path, out: Path,
                 loan: int, lent: int, max_borrow: int, stream: StreamPlan,
                 systems: tuple[str, ...], fraction: float, mapped: MappedPlan):
        self.out = out
        self.systems = systems
        self.rendezvous = tempfile.mkdtemp(prefix="multiturn-")
        self.stream_rendezvous = tempfile.mkdtemp(prefix="multiturn-stream-")
        self.mapped_rendezvous = tempfile.mkdtemp(prefix="multiturn-mapped-")
        self.specs = {k: v for k, v in specs(plan, loan, lent, stream, mapped).items()
                      if k in systems}
        self.busy = {}
        self.donors = []
        self.traces: dict[str, dict[str, Path]] = {}
        self.offsets: dict[Path, int] = {}
        for name, spec in self.specs.items():
            args = (stream_args(self.stream_rendezvous, fraction) if name == "swiftcache_stream"
                    else stream_args(self.mapped_rendezvous, mapped.fraction, depth=0)
                    if name == "swiftcache_mapped"
                    else spec.busy_args(plan, self.rendezvous, max_borrow))
            srv = bench_server(busy_model, spec, "busy", spec.busy_pool, args, plan, out, False)
            paths = {"forward": out / f"{name}-busy.forward.jsonl",
                     "loads": out / f"{name}-busy.loads.jsonl"}
            for p in paths.values():
                p.unlink(missing_ok=True)
            srv.env = instruments_env(srv.env, forward_trace=str(paths["forward"].resolve()),
                                      load_trace=str(paths["loads"].resolve()))
            self.busy[name], self.traces[name] = srv, paths
        for name, rendezvous in (("swiftcache", self.rendezvous),
                                 ("swiftcache_stream", self.stream_rendezvous),
                                 ("swiftcache_mapped", self.mapped_rendezvous)):
            if name in self.specs:
                sw = self.specs[name]
                self.donors.append(bench_server(donor_model, sw, "donor", sw.donor_pool,
                                                sw.donor_args(plan, rendezvous), plan, out,
                                                False))

    def start(self) -> dict:
        """Start every server; wait for the borrower's lease, the stream store's pages and the
        depth-0 pool's pieces on their donors. Returns what the two placed."""
        start_all([*self.busy.values(), *self.donors])
        placed: dict = {}
        if "swiftcache" in self.specs:
            wait_for_lease(self.rendezvous, timeout_s=300)
        if "swiftcache_stream" in self.specs:
            placed.update(wait_store_on_donor(self.busy["swiftcache_stream"]))
        if "swiftcache_mapped" in self.specs:
            placed.update(wait_store_on_donor(self.busy["swiftcache_mapped"],
                                              pattern=MAPPED_PLACED,
                                              key="mapped_pieces_on_donor"))
        return placed

    def stop(self) -> None:
        for srv in [*self.busy.values(), *self.donors]:
            srv.stop()

    def _new_lines(self, path: Path) -> list[dict]:
        lines, self.offsets[path] = _read_lines(path, self.offsets.get(path, 0))
        return lines

    def run(self, name: str, load: Workload, prompts: Prompts) -> dict:
        srv = self.busy[name]
        _post(srv.base_url, "/flush_cache")
        time.sleep(1.0)  # the original's pause after its flush
        for p in self.traces[name].values():
            self._new_lines(p)  # what came before this run is not its
        swift = name == "swiftcache"
        rows0 = donor_reads(srv.log_text()) if name == "swiftcache_stream" else 0
        stats0 = _swift_stats(srv.base_url) if swift else {}
        work0 = read_work(srv.base_url, settle=True) if swift else None
        load_before = os.getloadavg()
        t0 = time.monotonic()
        turns = asyncio.run(drive(srv.base_url, load, prompts))
        wall = time.monotonic() - t0
        load_after = os.getloadavg()
        stats = {}
        if swift:
            s1 = _swift_stats(srv.base_url)
            stats = {k: s1.get(k, 0) - stats0.get(k, 0) for k in s1}
            stats["swiftcache_borrowed_tokens"] = s1.get("swiftcache_borrowed_tokens")
        if name == "swiftcache_stream":  # its store's reads from donor pages (its log's stats)
            stats["stream_rows_from_donor"] = donor_reads(srv.log_text()) - rows0
        work = breakdown(work0, read_work(srv.base_url, settle=True), len(turns),
                         "request") if swift else None
        fwd = [{"start": f["end_unix"] - f["wall_ms"] / 1e3, "end": f["end_unix"],
                "mode": f["mode"], "new_tokens": f["new_tokens"]}
               for f in self._new_lines(self.traces[name]["forward"]) if "end_unix" in f]
        extends = sorted((f for f in fwd if f["mode"] == "EXTEND"), key=lambda f: f["end"])
        loads = phases.load_index(self._new_lines(self.traces[name]["loads"]))
        rows = [asdict(t) for t in turns]
        for row in rows:
            row.pop("text")
            row["timeline"] = phases.timeline(row, extends, loads)
        return {"turns": rows, "wall_s": round(wall, 1), "stats": stats, "work": work,
                "loadavg": [round(x, 2) for x in (*load_before, *load_after)],
                "forwards": len(fwd)}


def run_summary(run: dict) -> dict:
    """TTFT figures, cached tokens and phase statistics of one run."""
    ttft = [t["ttft"] * 1e3 for t in run["turns"]]
    timelines = [t["timeline"] for t in run["turns"]]
    return {"requests": len(ttft), "ttft_avg_ms": sum(ttft) / len(ttft),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90),
            "ttft_p99_ms": pct(ttft, 99),
            "cached_tokens": sum(t["cached_tokens"] for t in run["turns"]),
            "prompt_tokens": sum(t["prompt_tokens"] for t in run["turns"]),
            "phases": phases.phase_stats(timelines),
            "tail": phases.tail_breakdown(timelines, ttft),
            "loadavg": run["loadavg"], "wall_s": run["wall_s"]}


def point(runs: dict[str, dict]) -> dict:
    """One client count and seed: the runs' summaries and each SwiftCache mode's ratios (its
    keys prefixed by PREFIX)."""
    s = {name: run_summary(run) for name, run in runs.items()}
    st, ide, tw = s["stock"], s["ideal"], s["ideal_twin"]
    out: dict = {"runs": s,
                 "twin_ttft_avg_vs_ideal": tw["ttft_avg_ms"] / ide["ttft_avg_ms"],
                 "twin_ttft_p99_vs_ideal": tw["ttft_p99_ms"] / ide["ttft_p99_ms"]}
    for mode in MODES:
        if mode not in s:
            continue
        sw, pre = s[mode], PREFIX[mode]
        out[pre + "ttft_p99_vs_stock"] = sw["ttft_p99_ms"] / st["ttft_p99_ms"]
        out[pre + "ttft_avg_vs_ideal"] = sw["ttft_avg_ms"] / ide["ttft_avg_ms"]
        out[pre + "ttft_p99_vs_ideal"] = sw["ttft_p99_ms"] / ide["ttft_p99_ms"]
        slow = phases.slowest_phase(sw["phases"])
        if slow is not None:
            slow["stock_p99_ms"] = (st["phases"].get(slow["phase"]) or {}).get("p99")
        out[pre + "slowest_phase_p99"] = slow
        out[pre + "phase_p99_excess_vs_stock"] = phases.largest_excess(sw["phases"],
                                                                       st["phases"])
        out[pre + "ttft_gap_split"] = gap_split(runs[mode]["turns"], runs["ideal"]["turns"])
        out[pre + "swift_stats"] = runs[mode]["stats"]
        out[pre + "swift_work_per_request"] = runs[mode]["work"]
    return out


def gap_split(turns: list[dict], ideal: list[dict]) -> dict:
    """Where a mode's mean TTFT went against the ideal's (ms, this mode minus the ideal):
    - `uncached_ms`: what its uncached prompt tokens (prompt - cached) cost at the ideal's own
      speed: the ideal's least-squares line of TTFT on uncached tokens, averaged over this
      mode's requests, minus the ideal's mean (the ideal's larger cache shows here);
    - `queue_ms`: its mean wait for admission (the `queue` phase) minus the ideal's (the
      ideal's larger pool for the requests in flight shows here);
    - `other_ms`: the rest (prefill and everything around it, slower or faster);
    and, within `queue_ms`, `queue_behind_running_ms`: the part of that longer wait spent while
    another request was running (`phases.queue_behind_running`: behind the device room the
    requests in flight hold; the ideal's larger pool admits them side by side).
    The histories differ between servers (each turn's question follows the answers' timing),
    so requests are compared by their uncached tokens, not one by one."""
    def uncached(ts):
        return [t["prompt_tokens"] - t["cached_tokens"] for t in ts]

    def queue(ts):
        waits = [t["timeline"]["admitted"] - t["timeline"]["queued"] for t in ts
                 if "admitted" in (t.get("timeline") or {})]
        return sum(waits) / len(waits) if waits else 0.0

    def mean(xs):
        return sum(xs) / len(xs)

    def behind(ts):
        waits = phases.queue_behind_running([t["timeline"] for t in ts if t.get("timeline")])
        return sum(waits) / len(waits) if waits else 0.0

    x, y = uncached(ideal), [t["ttft"] for t in ideal]
    mx, my = mean(x), mean(y)
    var = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / var if var else 0.0
    gap = mean([t["ttft"] for t in turns]) - my
    cost = slope * (mean(uncached(turns)) - mx)
    waited = queue(turns) - queue(ideal)
    return {"gap_ms": gap * 1e3, "uncached_ms": cost * 1e3, "queue_ms": waited * 1e3,
            "other_ms": (gap - cost - waited) * 1e3, "ms_per_uncached_token": slope * 1e3,
            "queue_behind_running_ms": behind(turns) - behind(ideal)}


def point_keys(p: dict) -> list[str]:
    """The ratio and phase keys of one point, for its progress line."""
    return [k for k in p if k.endswith(("_vs_stock", "_vs_ideal", "slowest_phase_p99"))]


def over_seeds(points: list[dict]) -> dict:
    """Means over the seeds, the worst seed (the largest ratio), the spread (max - min) and each
    seed's value, in the order the seeds ran."""
    out: dict = {"seeds": len(points)}
    for mode in (m for m in MODES if PREFIX[m] + "ttft_avg_vs_ideal" in points[0]):
        out.update(_mode_over_seeds(points, PREFIX[mode]))
    for key in TWIN_RATIOS:
        out[key] = _spread([p[key] for p in points])
    return out


def _spread(vals: list[float]) -> dict:
    return {"mean": sum(vals) / len(vals), "worst": max(vals), "spread": max(vals) - min(vals),
            "per_seed": list(vals)}


def _mode_over_seeds(points: list[dict], pre: str) -> dict:
    out: dict = {pre + k: _spread([p[pre + k] for p in points]) for k in SWIFT_RATIOS}
    slow = [p[pre + "slowest_phase_p99"] for p in points if p[pre + "slowest_phase_p99"]]
    if slow:
        worst = max(slow, key=lambda x: x["p99_ms"])
        by: dict[str, list[float]] = {}
        for x in slow:
            by.setdefault(x["phase"], []).append(x["p99_ms"])
        name = max(by, key=lambda k: sum(by[k]) / len(points))
        out[pre + "slowest_phase_p99"] = {"mean": {"phase": name,
                                                   "p99_ms": sum(by[name]) / len(by[name]),
                                                   "seeds": len(by[name])},
                                          "worst": worst}
    gaps = [p[pre + "ttft_gap_split"] for p in points if pre + "ttft_gap_split" in p]
    if gaps:
        out[pre + "ttft_gap_split"] = {k: sum(g[k] for g in gaps) / len(gaps) for k in gaps[0]}
    excess = [p[pre + "phase_p99_excess_vs_stock"] for p in points
              if p[pre + "phase_p99_excess_vs_stock"]]
    if excess:
        out[pre + "phase_p99_excess_vs_stock"] = {
            "per_seed": [x["phase"] for x in excess],
            "worst": max(excess, key=lambda x: x["excess_ms"])}
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_multiturn.py", description=__doc__.splitlines()[0])
    d = Workload()
    ap.add_argument("--quick", action="store_true", help="8 and 16 clients, seeds 1 and 2")
    ap.add_argument("--clients", default=None, help="client counts (default 8,16,32)")
    ap.add_argument("--seeds", default=None, help="seeds (default 1,2,3)")
    ap.add_argument("--num-rounds", type=int, default=d.rounds)
    ap.add_argument("--request-length", type=int, default=d.request_length)
    ap.add_argument("--output-length", type=int, default=d.output_length)
    ap.add_argument("--max-parallel", type=int, default=d.max_parallel)
    ap.add_argument("--request-rate", type=float, default=d.request_rate)
    ap.add_argument("--distribution", default=d.distribution)
    ap.add_argument("--ready-queue-policy", default=d.ready_queue_policy)
    ap.add_argument("--busy-pool", type=int, default=1024)
    ap.add_argument("--donor-pool", type=int, default=16384)
    ap.add_argument("--lend-fraction", type=float, default=0.5)
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"the SwiftCache servers to run, of {', '.join(MODES)} (default "
                         f"{', '.join(DEFAULT_MODES)})")
    ap.add_argument("--stream-resident-fraction", type=float, default=0.5,
                    help="swiftcache_stream's --swiftcache-layer-stream-resident-fraction")
    ap.add_argument("--out", type=Path, default=Path("runs/multiturn"))
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: some of {', '.join(MODES)}, not {args.modes!r}")
    args.systems = tuple(s for s in SYSTEMS if s in modes or s not in MODES)
    args.client_counts = [int(x) for x in (args.clients or ("8,16" if args.quick else "8,16,32"))
                          .split(",") if x]
    args.seed_list = [int(x) for x in (args.seeds or ("1,2" if args.quick else "1,2,3"))
                      .split(",") if x]
    return args


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from ..tools.tiny_model import ensure_tiny_model

    args = parse(argv)
    started = time.monotonic()
    busy_model, donor_model = ensure_tiny_model(shape="small"), ensure_tiny_model(shape="tiny")
    busy, donor = ModelFacts.from_dir(busy_model), ModelFacts.from_dir(donor_model)
    plan = NodePlan(busy_pool=args.busy_pool, donor_pool=args.donor_pool,
                    lend_fraction=args.lend_fraction)
    loan, lent = plan.planned_loan(busy, donor)
    tok = AutoTokenizer.from_pretrained(str(busy_model))
    base = Workload(rounds=args.num_rounds, request_length=args.request_length,
                    output_length=args.output_length, max_parallel=args.max_parallel,
                    request_rate=args.request_rate, distribution=args.distribution,
                    ready_queue_policy=args.ready_queue_policy)
    args.out.mkdir(parents=True, exist_ok=True)
    stream = stream_plan(plan, busy, donor, args.stream_resident_fraction)
    mapped = mapped_plan(plan, busy, donor, loan)
    bench = Bench(plan, busy_model, donor_model, args.out, loan, lent,
                  plan.lendable_busy_tokens(busy, donor), stream, args.systems,
                  args.stream_resident_fraction, mapped)
    print(f"pools: busy {plan.busy_pool}, SwiftCache's loan {loan} busy tokens ({lent} donor "
          f"tokens), ideal {plan.busy_pool + loan}; streamed {asdict(stream)}; mapped "
          f"{asdict(mapped)}; load "
          f"{asdict(base)}", flush=True)
    detail: dict = {}
    summary: dict = {}
    try:
        placed = bench.start()
        wait_until_quiet()  # the servers' start-up load would fall on the first runs only
        turn = 0
        for n in args.client_counts:
            points = []
            for seed in args.seed_list:
                load = replace(base, clients=n, seed=seed)
                prompts = Prompts.build(load, tok.vocab_size, tok.num_special_tokens_to_add(),
                                        tok.decode)
                k = turn % len(args.systems)
                order = args.systems[k:] + args.systems[:k]
                turn += 1
                runs = {}
                for name in order:
                    runs[name] = bench.run(name, load, prompts)
                    r = run_summary(runs[name])
                    print(f"[{n} clients, seed {seed}] {name}: cached {r['cached_tokens']} of "
                          f"{r['prompt_tokens']}, TTFT avg {r['ttft_avg_ms']:.0f} ms, P90 "
                          f"{r['ttft_p90_ms']:.0f}, P99 {r['ttft_p99_ms']:.0f}; load "
                          f"{r['loadavg'][:3]} -> {r['loadavg'][3:]}", flush=True)
                p = point(runs)
                p.update(clients=n, seed=seed, order=list(order))
                points.append(p)
                detail[f"{n}-{seed}"] = {"point": p, "runs": runs}
                (args.out / "multiturn.json").write_text(json.dumps(detail, indent=1))
                print(f"[{n} clients, seed {seed}] " + json.dumps(
                    {k: p[k] for k in point_keys(p)}), flush=True)
            summary[str(n)] = over_seeds(points)
    finally:
        bench.stop()
    summary.update(load=asdict(base), pools={"busy": plan.busy_pool, "loan": loan,
                                             "ideal": plan.busy_pool + loan,
                                             "stream": {**asdict(stream), **{
                                                 k: v for k, v in placed.items()
                                                 if k.startswith("store_")}},
                                             "mapped": {**asdict(mapped), **{
                                                 k: v for k, v in placed.items()
                                                 if k.startswith("mapped_")}}},
                   wall_s=round(time.monotonic() - started), quick=args.quick,
                   device=f"CPU only ({os.cpu_count()} cores)")
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0
