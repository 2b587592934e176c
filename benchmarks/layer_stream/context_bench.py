"""bench_context: how long a context a live server serves at equal local KV memory, and what
streaming costs (scripts/bench_context.py runs `main`).

Three real SGLang CPU servers on the small model (L = 8 layers, fp32 KV):
- stock SGLang with a KV pool of P tokens: local KV = L * (P + 1) rows of one layer;
- SwiftCache with --swiftcache-layer-stream host, depth D, and a pool of N = L*(P+1)/D - 1
  tokens: local KV = D * (N + 1) rows, the same bytes (the other layers live in host memory);
  with `--backing donor`, --swiftcache-layer-stream donor and a fourth server, a donor on the
  tiny model lending pages of its own pool for the whole store (the sweep starts once every
  store page is on the donor; writes still go through to host memory);
- stock SGLang with a pool large enough for everything: the reference outputs, and the
  "resident" twin of a streamed request in the cost measurements.
A context c is served when a prompt of c - OUT tokens returns OUT greedy tokens equal to the
reference's; the longest served c of each server is found by a binary search. Costs: a prompt
near the streamed server's limit, 1 + K new tokens, on the streamed server and on the resident
one (a new salt each time, so nothing is a cache hit). Both servers trace every forward pass
(SWIFTCACHE_FORWARD_TRACE, `benchmarks.instruments`) and run one compute thread, so a forward's
thread CPU time is its cost even on a shared machine: prefill per token = the prompt's extend
forwards / its tokens, decode step = the median decode forward; medians over repeats taken
alternately.
The GPU estimate beside them is `cost_model.expected_costs` (bandwidths with sources).

With `--resident-fraction f` > 0 the streamed server keeps that fraction of its local KV memory as
resident rows (every layer's own; `--swiftcache-layer-stream-resident-fraction`), and its pool N
is the largest whose local memory, `L R + D (N + 1 - R)` rows with R rounded as the pool rounds it
(`ResidentPlan`), is at most the stock pool's: about (f + (1 - f) L/D) (P + 1) - 1 tokens. The
cost part then also measures a SHORT request, one that fits in the resident slots (R/2 tokens),
against the resident twin, and counts the rows each request copied (loaded from and written
through to the store, from the forward trace): none for the short one. Both servers' radix caches
are flushed before each of these requests, so each gets the lowest free slots (the resident ones
first), whatever the sweep left cached.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

from ..instruments import instruments_env
from . import cost_model
from .context_resident import ResidentPlan, check_resident_pool, short_prompt_len
from .context_servers import (
    ContextProbe,
    donor_reads,
    flush_cache,
    generate,
    longest_served,
    model_shape,
    prompt_ids,
    read_trace,
    streamed_pool_log,
    wait_store_on_donor,
)


@dataclass(frozen=True)
class Setup:
    pool: int  # P: the stock server's pool, and the streamed server's local memory in tokens
    layers: int
    depth: int
    out_tokens: int
    chunk: int
    decode_steps: int
    repeats: int
    backing: str = "host"  # where the streamed server's layers live: host, or donor

    @property
    def streamed_pool(self) -> int:
        return self.layers * (self.pool + 1) // self.depth - 1

    @property
    def reference_pool(self) -> int:
        return max(4096, 2 * self.streamed_pool)

    def donor_pool(self, page_bytes: int, donor_page_bytes: int) -> int:
        """A donor pool that lends the whole store: at watermark 0.5 a donor of S tokens lends
        down to S/2 + S/16 free, i.e. 7S/16 (lending.py)."""
        need = -(-(self.streamed_pool + 1) * page_bytes // donor_page_bytes)
        return -(-need * 16 // 7) + 64


def measure_costs(servers: dict, traces: dict, prompt_len: int, setup: Setup) -> dict:
    """Prefill per token and decode step of one request on the "streamed" and "resident"
    servers, from their forward traces (thread CPU time: what the forward cost, whatever else
    ran on the machine) and from the client's clock; medians over repeats taken alternately."""
    return measure_with_rows(servers, traces, prompt_len, setup)[0]


def measure_with_rows(servers: dict, traces: dict, prompt_len: int, setup: Setup,
                      prepare: Callable | None = None, salt: int = 10_000) -> tuple[dict, dict]:
    """`measure_costs`' figures, and the streamed server's rows copied (loaded from and written
    through to the store): the most any one request copied, and the median rows loaded per
    decode step. `prepare(server)` runs before each request (a cache flush)."""
    keys = ("prefill_cpu", "step_cpu", "prefill_wall", "step_wall", "prefill_copy", "step_copy")
    samples = {name: {k: [] for k in keys} for name in servers}
    copied, step_loaded = [], []
    offsets = {name: read_trace(traces[name], 0)[1] for name in servers}
    for _ in range(setup.repeats):
        for name, server in servers.items():
            salt += 1
            if prepare is not None:
                prepare(server)
            generate(server, prompt_ids(prompt_len, salt), 1 + setup.decode_steps)
            records, offsets[name] = read_trace(traces[name], offsets[name])
            prefill = [r for r in records if r["mode"] in ("EXTEND", "MIXED")]
            decode = [r for r in records if r["mode"] == "DECODE" and r["bs"] == 1]
            if not prefill or not decode:
                raise RuntimeError(f"no forward trace from the {name} server in {traces[name]}")
            for unit, key in (("cpu", "cpu_ms"), ("wall", "wall_ms"), ("copy", "copy_ms")):
                samples[name][f"prefill_{unit}"].append(sum(r[key] for r in prefill) / prompt_len)
                samples[name][f"step_{unit}"].append(statistics.median(r[key] for r in decode))
            if name == "streamed":
                copied.append(sum(r.get("rows_loaded", 0) + r.get("rows_saved", 0)
                                  for r in records))
                step_loaded.append(statistics.median(r.get("rows_loaded", 0) for r in decode))
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    rows = {"rows_copied_per_request": max(copied),
            "rows_loaded_per_decode_step": statistics.median(step_loaded)}
    return cost_figures(med, prompt_len, setup), rows


def cost_figures(med: dict, prompt_len: int, setup: Setup) -> dict:
    st, re_ = med["streamed"], med["resident"]
    return {"prompt_tokens": prompt_len, "decode_steps": setup.decode_steps,
            "repeats": setup.repeats, "clock": "thread CPU time of the forward (wall beside it)",
            "decode_step_ms_streamed": st["step_cpu"], "decode_step_ms_resident": re_["step_cpu"],
            "decode_step_ratio": st["step_cpu"] / re_["step_cpu"],
            "prefill_ms_per_token_streamed": st["prefill_cpu"],
            "prefill_ms_per_token_resident": re_["prefill_cpu"],
            "prefill_token_ratio": st["prefill_cpu"] / re_["prefill_cpu"],
            "copy_ms_per_decode_step": st["step_copy"],
            "copy_ms_per_prefill_token": st["prefill_copy"],
            "wall": {"decode_step_ms_streamed": st["step_wall"],
                     "decode_step_ms_resident": re_["step_wall"],
                     "prefill_ms_per_token_streamed": st["prefill_wall"],
                     "prefill_ms_per_token_resident": re_["prefill_wall"]}}


def donor_server(setup: Setup, model_dir, env: dict):
    """(the donor server, the control options its borrower needs): the tiny model lending half
    of a pool sized for the whole store of `setup`'s streamed server."""
    from ..tools.local_server import LocalServer
    from ..tools.tiny_model import ensure_tiny_model

    tiny = ensure_tiny_model()
    page = lambda shape: shape["layers"] * shape["row_bytes"]  # noqa: E731 - bytes per token
    pool = setup.donor_pool(page(model_shape(model_dir)), page(model_shape(tiny)))
    control = ["--swiftcache-rendezvous-dir", tempfile.mkdtemp(prefix="bench-context-rv-"),
               "--swiftcache-heartbeat-timeout-s", "3", "--swiftcache-heartbeat-interval-s", "0.3"]
    donor = LocalServer(tiny, swiftcache=True, max_total_tokens=pool,
                        extra_args=["--dtype", "float32", "--swiftcache-role", "donor",
                                    "--swiftcache-lend-fraction", "0.5",
                                    "--swiftcache-reclaim-watermark", "0.5", *control],
                        log_path="/tmp/bench-context-donor.log", env=env)
    return donor, control


def run(setup: Setup, model_dir, resident_fraction: float = 0.0) -> dict:
    from ..tools.local_server import LocalServer, start_all

    row = model_shape(model_dir)["row_bytes"]
    plan = ResidentPlan.fit(setup, resident_fraction, row // 2) if resident_fraction > 0 \
        else None
    pool_tokens = plan.tokens if plan is not None else setup.streamed_pool
    common = ["--dtype", "float32", "--chunked-prefill-size", str(setup.chunk)]
    traces = {name: f"{tempfile.gettempdir()}/bench-context-{os.getpid()}-{name}.jsonl"
              for name in ("streamed", "resident")}
    for path in traces.values():
        open(path, "w").close()

    def env(trace: str | None) -> dict:
        # one compute thread per server: the forward's thread CPU time is then all its work
        return instruments_env({**os.environ, "OMP_NUM_THREADS": "1"}, forward_trace=trace)

    stock = LocalServer(model_dir, swiftcache=False, max_total_tokens=setup.pool,
                        extra_args=common, log_path="/tmp/bench-context-stock.log", env=env(None))
    donor, control = donor_server(setup, model_dir, env(None)) if setup.backing == "donor" \
        else (None, [])
    streamed = LocalServer(model_dir, swiftcache=True, max_total_tokens=pool_tokens,
                           extra_args=[*common, "--swiftcache-layer-stream", setup.backing,
                                       "--swiftcache-layer-stream-depth", str(setup.depth),
                                       "--swiftcache-layer-stream-resident-fraction",
                                       f"{resident_fraction:g}",
                                       *control],
                           log_path="/tmp/bench-context-streamed.log",
                           env=env(traces["streamed"]))
    reference = LocalServer(model_dir, swiftcache=False, max_total_tokens=setup.reference_pool,
                            extra_args=common, log_path="/tmp/bench-context-reference.log",
                            env=env(traces["resident"]))
    servers = [stock, streamed, reference] + ([donor] if donor is not None else [])
    t0 = time.perf_counter()
    placed: dict = {}
    try:
        start_all(servers)
        if plan is not None:
            check_resident_pool(plan, setup, streamed.log_text(), row)
        if donor is not None:
            placed = wait_store_on_donor(streamed)
        started_s = time.perf_counter() - t0
        cache: dict[int, list[int]] = {}

        def reference_outputs(context: int) -> list[int]:
            if context not in cache:
                cache[context] = generate(reference, prompt_ids(context - setup.out_tokens,
                                                                context), setup.out_tokens)
            return cache[context]

        lo = setup.out_tokens + 1
        stock_probe = ContextProbe(stock, reference_outputs, setup.out_tokens)
        stock_max = longest_served(stock_probe, lo, setup.pool + setup.out_tokens)
        streamed_probe = ContextProbe(streamed, reference_outputs, setup.out_tokens)
        streamed_max = longest_served(streamed_probe, lo, pool_tokens + setup.out_tokens)
        sweep_s = time.perf_counter() - t0 - started_s
        prompt_len = streamed_max - setup.decode_steps - 1
        twins = {"streamed": streamed, "resident": reference}
        pool_log = streamed_pool_log(streamed.log_text())
        if plan is None:
            costs = measure_costs(twins, traces, prompt_len, setup)
        else:
            costs, resident = measure_resident(plan, twins, traces, prompt_len, setup)
        if donor is not None:
            time.sleep(6.0)  # the runtime logs its stats every 5 s
            placed.update(rows_read_from_donor=donor_reads(streamed.log_text()),
                          donor_pool=int(donor.args[donor.args.index("--max-total-tokens") + 1]))
    finally:
        for s in servers:
            s.stop()
    result = {
        "setup": asdict(setup), "streamed_pool": pool_tokens,
        "reference_pool": setup.reference_pool,
        "local_kv_bytes_stock": setup.layers * (setup.pool + 1) * row,
        "local_kv_bytes_swiftcache": (plan.local_rows if plan is not None else
                                      setup.depth * (setup.streamed_pool + 1)) * row,
        "streamed_server_log": pool_log,
        "max_context_stock": stock_max, "max_context_swiftcache": streamed_max,
        "max_context_ratio": streamed_max / max(stock_max, 1),
        "identical": stock_probe.identical and streamed_probe.identical,
        "probes": {"stock": stock_probe.verdicts, "swiftcache": streamed_probe.verdicts},
        "costs_cpu": costs, "expected_gpu": cost_model.expected_costs(),
        "gpu_sources": cost_model.sources(),
        "backing": setup.backing, "donor": placed,
        "startup_s": round(started_s, 1), "sweep_s": round(sweep_s, 1),
    }
    if plan is not None:
        result["resident"] = resident
    return result


def measure_resident(plan: ResidentPlan, twins: dict, traces: dict, long_len: int,
                     setup: Setup) -> tuple[dict, dict]:
    """With resident rows: the long request (near the limit) and a short one (R/2 tokens, which
    fits in the resident slots with its output), each after a flush of both servers' caches.
    Returns (the long request's costs, the resident section of the result)."""
    short_len = short_prompt_len(plan.resident, setup.decode_steps)
    costs, long_rows = measure_with_rows(twins, traces, long_len, setup, prepare=flush_cache)
    short, short_rows = measure_with_rows(twins, traces, short_len, setup, prepare=flush_cache,
                                          salt=20_000)
    return costs, {"fraction": plan.fraction, "pool_tokens": plan.tokens,
                   "resident_tokens": plan.resident, "local_rows": plan.local_rows,
                   "long": long_rows, "short": {**short, **short_rows}}


def report(result: dict) -> str:
    c, res = result["costs_cpu"], result.get("resident")
    layout = (f"pool {result['streamed_pool']} x {result['setup']['depth']} staging layers"
              if res is None else
              f"pool {result['streamed_pool']}: {res['resident_tokens']} resident tokens x "
              f"{result['setup']['layers']} layers, the rest x {result['setup']['depth']} "
              f"staging layers (resident fraction {res['fraction']:g})")
    lines = [
        f"local KV memory: stock {result['local_kv_bytes_stock'] / 2**20:.2f} MiB "
        f"(pool {result['setup']['pool']} x {result['setup']['layers']} layers), SwiftCache "
        f"{result['local_kv_bytes_swiftcache'] / 2**20:.2f} MiB ({layout}; its log: "
        f"{result['streamed_server_log']['local_mib']} MiB local, "
        f"{result['streamed_server_log']['store_mib']} MiB in "
        f"{result['streamed_server_log']['store']})",
        f"longest context served identically: stock {result['max_context_stock']}, SwiftCache "
        f"{result['max_context_swiftcache']} -> ratio {result['max_context_ratio']:.3f}; "
        f"identical={result['identical']}",
        f"CPU costs at a {c['prompt_tokens']}-token prompt: decode step "
        f"{c['decode_step_ms_streamed']:.1f} ms streamed vs {c['decode_step_ms_resident']:.1f} ms "
        f"resident (x{c['decode_step_ratio']:.2f}); prefill "
        f"{c['prefill_ms_per_token_streamed']:.3f} vs "
        f"{c['prefill_ms_per_token_resident']:.3f} ms/token (x{c['prefill_token_ratio']:.2f}); "
        f"of which layer copies {c['copy_ms_per_decode_step']:.2f} ms per step, "
        f"{c['copy_ms_per_prefill_token']:.4f} ms per prefill token",
    ]
    if res is not None:
        sh, lr = res["short"], res["long"]
        lines += [
            f"  rows copied (loaded + written through) per request: {lr['rows_copied_per_request']}"
            f" ({lr['rows_loaded_per_decode_step']:.0f} loaded per decode step)",
            f"short request ({sh['prompt_tokens']}-token prompt, in the resident slots): decode "
            f"step {sh['decode_step_ms_streamed']:.1f} ms streamed vs "
            f"{sh['decode_step_ms_resident']:.1f} ms resident (x{sh['decode_step_ratio']:.2f}); "
            f"prefill {sh['prefill_ms_per_token_streamed']:.3f} vs "
            f"{sh['prefill_ms_per_token_resident']:.3f} ms/token "
            f"(x{sh['prefill_token_ratio']:.2f});"
            f" rows copied per request {sh['rows_copied_per_request']}",
        ]
    lines += [
        "expected on GPUs (Qwen3-32B, 32k context; formula in layer_stream/cost_model.py):",
    ]
    for r in result["expected_gpu"]:
        lines.append(f"  {r['gpu']:5s} {r['link']:24s} {r['link_GBps']:6.1f} GB/s: decode step "
                     f"{r['decode_streamed_ms']:.1f} vs {r['decode_resident_ms']:.1f} ms "
                     f"(x{r['decode_step_ratio']:.2f}), prefill token "
                     f"x{r['prefill_token_ratio']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small pool, fewer repeats (~5 min)")
    ap.add_argument("--pool", type=int, help="P, the stock pool in tokens (default 128; 512 full)")
    ap.add_argument("--depth", type=int, default=2, help="staging layers of the streamed server")
    ap.add_argument("--backing", choices=("host", "donor"), default="host",
                    help="where the streamed server's layers live: host memory, or pages of a "
                         "donor server's pool (a fourth server, the tiny model) under a lease")
    ap.add_argument("--resident-fraction", type=float, default=0.0, metavar="F",
                    help="the streamed server's --swiftcache-layer-stream-resident-fraction, its "
                         "pool sized so its local KV memory is at most the stock pool's; adds a "
                         "short request (in the resident slots) to the costs (default 0: every "
                         "row streamed)")
    ap.add_argument("--json", help="also write the result object to this file")
    args = ap.parse_args(argv)
    if not 0.0 <= args.resident_fraction <= 0.95:
        ap.error("--resident-fraction must be in [0, 0.95] (the server's option's range)")
    from ..tools.tiny_model import ensure_tiny_model

    model_dir = ensure_tiny_model(shape="small")
    shape = model_shape(model_dir)
    setup = Setup(pool=args.pool or (128 if args.quick else 512), layers=shape["layers"],
                  depth=args.depth, out_tokens=8, chunk=256 if args.quick else 512,
                  decode_steps=16 if args.quick else 32, repeats=3 if args.quick else 5,
                  backing=args.backing)
    result = run(setup, model_dir, args.resident_fraction)
    print(report(result), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    summary = {k: result[k] for k in ("max_context_stock", "max_context_swiftcache",
                                      "max_context_ratio", "identical")}
    summary.update({k: round(result["costs_cpu"][k], 4) for k in (
        "decode_step_ratio", "prefill_token_ratio", "decode_step_ms_streamed",
        "decode_step_ms_resident", "prefill_ms_per_token_streamed",
        "prefill_ms_per_token_resident", "copy_ms_per_decode_step", "copy_ms_per_prefill_token")})
    summary.update(local_kv_bytes_stock=result["local_kv_bytes_stock"],
                   local_kv_bytes_swiftcache=result["local_kv_bytes_swiftcache"],
                   backing=args.backing, quick=args.quick)
    if result["donor"]:
        summary.update(result["donor"])
    if "resident" in result:
        res = result["resident"]
        summary.update(resident_fraction=res["fraction"], resident_tokens=res["resident_tokens"],
                       short_decode_step_ratio=round(res["short"]["decode_step_ratio"], 4),
                       short_rows_copied=res["short"]["rows_copied_per_request"])
    print(json.dumps(summary), flush=True)
    return 0 if result["identical"] else 1
