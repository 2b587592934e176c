"""`scripts/bench_sched_overhead.py`: time per scheduler step, SwiftCache against stock SGLang,
on one trace, in one run.

Every run serves the same multi-turn trace on the busy `small` model with the same KV pool (the
histories do not fit it, so the tree evicts), one request at a time, with the debug seam's step
observer (`benchmarks/instruments/traces.py`, `SWIFTCACHE_STEP_TRACE`): each scheduler loop
iteration that ran a forward, from its start to the next one's, and the forward's share of it.
Runs, in this order: `stock`, `no_donation` (SwiftCache, no lending or borrowing),
`borrower_no_hits` (a borrower alone on its node: a donor tier with no lease, so no hits),
`borrower_hits` (a borrower beside a `tiny` donor lending half its pool), `stock_twin` (stock
again, last: the noise floor, drift over the run included).

The last line is a JSON object: `overhead_ratio_no_donation`, `overhead_ratio_borrower` (with
hits) and `overhead_ratio_borrower_no_hits` are a run's mean step time over stock's;
`noise_ratio` is the twin's; `outside_forward_ms` per run is the mean step time minus its
forwards (the scheduler's own work: SwiftCache's tree, hooks and copies land there); `runs`
holds each run's steps and step time percentiles; `swift_work_per_step` per SwiftCache run is
where its scheduler thread's own SwiftCache time went, in ms per forward step by phase (the
server's `swiftcache_work_<phase>_seconds_total` over the trace, `benchmarks/instruments/work.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from .instruments import instruments_env
from .instruments.work import breakdown, read_work
from .loadgen.client import RequestRecord, chat
from .loadgen.stats import pct
from .nodebench.plan import COMMON_ARGS, HEARTBEAT_ARGS, ModelFacts
from .tools.demo import wait_for_lease
from .tools.local_server import LocalServer, start_all
from .tools.tiny_model import ensure_tiny_model
from .workloads.sharegpt import load_conversations

# the twin runs last: the noise floor then includes whatever drifts over the run (caches,
# clocks), which a ratio against the first run would otherwise credit to SwiftCache
RUNS = ("stock", "no_donation", "borrower_no_hits", "borrower_hits", "stock_twin")
POOL = 384
DONOR_POOL = 4096


async def _trace(url: str, convs, turns: int, max_tokens: int) -> list[RequestRecord]:
    import aiohttp

    out: list[RequestRecord] = []
    histories = [[] for _ in convs]
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for t in range(turns):
            for conv, msgs in zip(convs, histories):
                msgs.append({"role": "user", "content": conv.turns[t].user})
                rec = RequestRecord(session=conv.id, turn=t + 1, server="busy", t_send=0.0)
                await chat(http, url, list(msgs), max_tokens, rec, t0)
                if rec.error:
                    raise RuntimeError(f"request failed: {rec.error}")
                out.append(rec)
                msgs.append({"role": "assistant", "content": rec.text})
    return out


def _servers(run: str, busy_dir: Path, donor_dir: Path, work: Path, steps: Path) -> dict:
    rendezvous = str(work / f"rv-{run}")
    env = instruments_env(step_trace=str(steps))
    swift = ["--swiftcache-rendezvous-dir", rendezvous, *HEARTBEAT_ARGS]
    args = {"stock": [], "stock_twin": [], "no_donation": [],
            "borrower_no_hits": [*swift, "--swiftcache-role", "borrower",
                                 "--swiftcache-max-borrow-blocks", "1024"],
            "borrower_hits": [*swift, "--swiftcache-role", "borrower",
                              "--swiftcache-max-borrow-blocks", "1024"]}[run]
    out = {"busy": LocalServer(busy_dir, swiftcache=not run.startswith("stock"),
                               max_total_tokens=POOL, extra_args=[*COMMON_ARGS, *args], env=env,
                               log_path=work / f"{run}-busy.log")}
    if run == "borrower_hits":
        out["donor"] = LocalServer(donor_dir, max_total_tokens=DONOR_POOL,
                                   log_path=work / f"{run}-donor.log",
                                   extra_args=[*COMMON_ARGS, *swift, "--swiftcache-role", "donor",
                                               "--swiftcache-lend-fraction", "0.5"])
    return out, rendezvous


def _steps(path: Path) -> list[dict]:
    if not path.exists():
        raise RuntimeError(f"{path}: no step records (the step observer was not installed)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(steps: dict) -> dict:
    runs = {}
    for run, rows in steps.items():
        step = [r["step_ms"] for r in rows]
        outside = [r["step_ms"] - r["forward_ms"] for r in rows]
        runs[run] = {"steps": len(rows), "step_ms_mean": sum(step) / len(step),
                     "step_ms_p50": pct(step, 50), "step_ms_p99": pct(step, 99),
                     "outside_forward_ms_mean": sum(outside) / len(outside)}
    base = runs["stock"]["step_ms_mean"]

    def ratio(run: str):
        return runs[run]["step_ms_mean"] / base if run in runs else None

    return {"overhead_ratio_no_donation": ratio("no_donation"),
            "overhead_ratio_borrower": ratio("borrower_hits"),
            "overhead_ratio_borrower_no_hits": ratio("borrower_no_hits"),
            "noise_ratio": ratio("stock_twin"),
            "outside_forward_ms": {r: v["outside_forward_ms_mean"] for r, v in runs.items()},
            "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="4 conversations x 3 turns (default 6 x 4)")
    ap.add_argument("--out", type=Path, default=None, help="keep the logs and step records here")
    args = ap.parse_args(argv)
    convs_n, turns = (4, 3) if args.quick else (6, 4)
    work = args.out or Path(tempfile.mkdtemp(prefix="sched-overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    busy_dir, donor_dir = ensure_tiny_model(shape="small"), ensure_tiny_model(shape="tiny")
    busy = ModelFacts.from_dir(busy_dir)
    convs = load_conversations(convs_n, min_turns=turns, max_chars_per_message=200)
    t0 = time.monotonic()
    steps, texts, loadavg, swift_work = {}, {}, {}, {}
    for run in RUNS:
        path = work / f"{run}-steps.jsonl"
        path.unlink(missing_ok=True)
        servers, rendezvous = _servers(run, busy_dir, donor_dir, work, path)
        before = os.getloadavg()
        try:
            start_all(servers.values())
            if "donor" in servers:
                wait_for_lease(rendezvous, timeout_s=180)
            path.unlink(missing_ok=True)  # start-up's own steps are not the trace's
            url = servers["busy"].base_url
            work_before = read_work(url, settle=True)
            records = asyncio.run(_trace(url, convs, turns, 16))
            work_after = read_work(url, settle=True)
        finally:
            for s in servers.values():
                s.stop()
        steps[run] = _steps(path)
        swift_work[run] = breakdown(work_before, work_after, len(steps[run]), "forward step")
        texts[run] = [r.text for r in records]
        loadavg[run] = [round(x, 2) for x in before + os.getloadavg()]
        print(f"[{run}] {len(steps[run])} steps", flush=True)
    out = summarize(steps)
    out["swift_work_per_step"] = {run: w for run, w in swift_work.items() if w is not None}
    out["identical_to_stock"] = {run: texts[run] == texts["stock"] for run in RUNS}
    out["busy_model"] = busy.describe()
    out["trace"] = {"conversations": convs_n, "turns": turns, "pool_tokens": POOL}
    out["loadavg"] = loadavg
    out["wall_s"] = round(time.monotonic() - t0, 1)
    for run, v in out["runs"].items():
        print(f"{run:<18} {v['steps']:>5} steps  mean {v['step_ms_mean']:7.2f} ms  p99 "
              f"{v['step_ms_p99']:7.2f} ms  outside the forward {v['outside_forward_ms_mean']:6.2f}"
              " ms")
    for run, w in out["swift_work_per_step"].items():
        parts = "  ".join(f"{k} {v:.3f}" for k, v in w["ms"].items() if v)
        print(f"{run:<18} SwiftCache's own work {w['total_ms']:.3f} ms/step: {parts}")
    print(json.dumps(out, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
