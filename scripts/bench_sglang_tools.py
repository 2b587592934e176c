#!/usr/bin/env python3
"""Run SGLang's own benchmark tools, unchanged, against SwiftCache and stock servers.

  scripts/bench_sglang_tools.py --launch     # CPU demo: tiny model, SwiftCache off and on
  scripts/bench_sglang_tools.py --model PATH --server stock=http://127.0.0.1:30000 \
      --server swiftcache=http://127.0.0.1:30001 \
      [--bench-multiturn sglang/benchmark/hicache/bench_multiturn.py]

For every server: `python -m sglang.benchmark.serving` on random token ids (single requests) and on
its generated-shared-prefix multi-turn chat, then SGLang's benchmark/hicache/bench_multiturn.py when
its path is given (it is in SGLang's repository, not the wheel). Offline: the tokenizer is the
model's, the prompts are generated ids. Prints one line per tool and server; writes results.json.
See benchmarks/loadgen/sglang_tools.py.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.loadgen import sglang_tools  # noqa: E402


def run_tools(label: str, url: str, model: str, out: Path, a: argparse.Namespace) -> dict:
    res = {}
    for dataset in ("random-ids", "generated-shared-prefix"):
        res[dataset] = sglang_tools.serving_benchmark(url, model, out / f"{label}-{dataset}.jsonl",
                                                      dataset=dataset, num_prompts=a.num_prompts,
                                                      request_rate=a.rate)
    if a.bench_multiturn:
        res["bench_multiturn"] = sglang_tools.multiturn_benchmark(a.bench_multiturn, url, model,
                                                                  out / f"{label}-multiturn.jsonl",
                                                                  request_rate=a.rate)
    return res


def line(label: str, tool: str, r: dict) -> str:
    if tool == "bench_multiturn":
        s = r.get("summary", r)
        return f"{label:<14} {tool:<26} " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()
                                                      if isinstance(v, float))
    return (f"{label:<14} {tool:<26} completed {r['completed']:>4}  "
            f"TTFT mean {r['mean_ttft_ms']:8.1f} ms  P99 {r['p99_ttft_ms']:8.1f} ms  "
            f"throughput {r['request_throughput']:.2f} req/s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launch", action="store_true",
                   help="start the CPU demo servers (SwiftCache off, then on)")
    p.add_argument("--server", action="append", default=[], metavar="LABEL=URL")
    p.add_argument("--model",
                   help="model path (tokenizer) the servers run; --launch uses the tiny model")
    p.add_argument("--bench-multiturn",
                   help="path of SGLang's benchmark/hicache/bench_multiturn.py")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--rate", type=float, default=4.0, help="requests/s")
    p.add_argument("--out", default=None,
                   help="output directory (default runs/sglang-tools-<time>)")
    a = p.parse_args()
    out = Path(a.out or f"runs/sglang-tools-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    if missing := sglang_tools.missing_multiturn_imports():
        print(f"note: the installed sglang lacks {missing}; bench_multiturn.py would not run",
              file=sys.stderr)
    results = {}
    if a.launch:
        from benchmarks.tools.local_server import LocalServer
        from benchmarks.tools.tiny_model import DEFAULT_DIR, ensure_tiny_model

        a.model = str(ensure_tiny_model(DEFAULT_DIR, seed=0))
        for label, on in (("stock", False), ("swiftcache", True)):  # one at a time: 2 CPU cores
            with LocalServer(a.model, swiftcache=on,
                             extra_args=["--enable-cache-report"]) as server:
                results[label] = run_tools(label, server.base_url, a.model, out, a)
    elif not a.server or not a.model:
        p.error("give --launch, or --model PATH and one or more --server LABEL=URL")
    for label, url in (s.split("=", 1) for s in a.server):
        results[label] = run_tools(label, url, a.model, out, a)
    for label, by_tool in results.items():
        for tool, r in by_tool.items():
            print(line(label, tool, r))
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
