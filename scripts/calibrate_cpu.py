#!/usr/bin/env python3
"""Measure this CPU node for the simulator's validation (`scripts/simulate.py --validate`).

    .venv/bin/python scripts/calibrate_cpu.py [--out runs/calibration/cpu.json] [--plan quick|full]

Starts one stock SGLang server per bench_node model (busy `small`, donor `tiny`; the same flags
and one torch thread each, as bench_node starts them), side by side, and measures:
- prefill: client-side TTFT of streamed chat requests of synthetic prompts (seeded random words,
  not bench_node's traffic), cold and after a cached prefix; fitted as a + b new + c new ctx;
- decode: (end of stream - first token) / steps at three contexts; fitted as d0 + d1 ctx;
- the workload's tokens: bench_node's traffic (nodebench/traffic.py, same conversations and turn
  order) replayed greedily with `return_token_ids`, so the simulator knows every prompt's and
  answer's token ids (the workload, not a result: no timing or cache figure of it is kept);
then, with the servers stopped, the donor-tier copy bandwidth of `PoolTransferEngine` between the
two models' pool geometries (scripts/bench_transfer.py's pool-lease path).
Writes one JSON (benchmarks/simulator/cpu_calibration.py reads it). About 2-3 minutes here,
most of it server start-up.

    .venv/bin/python scripts/calibrate_cpu.py --bench tiers [--out runs/calibration/cpu_tiers.json]

measures the same node as bench_tiers runs it (its servers' environment: no thread limit, the
busy server timed alone, as bench_tiers' busy server serves while its donor idles), traces
bench_tiers' prompts on the busy model, and adds the host tier's copies: a store (every
layer) and a load (layer by layer) of N tokens through SwiftCache's `HostKV` over SGLang's host
pool, with the busy model's geometry, and that pool's capacity for each run's device pool and
--hicache-ratio. The trace is bench_tiers' own workload, not a replay of the model's own
histories: every bench_tiers run sends histories carrying run (r)'s answers, and run (r)'s
server (the plan's 384-token pool) cuts an answer or refuses a prompt that outgrows it, so run
(r) is replayed through bench_tiers' turn loop on a second server with run (r)'s arguments, and
each prompt it sent is tokenized (with its greedy answer) by the unlimited server.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchmarks.loadgen.client import RequestRecord, chat  # noqa: E402
from benchmarks.nodebench.plan import COMMON_ARGS, ModelFacts, NodePlan  # noqa: E402
from benchmarks.nodebench.traffic import build_traffic  # noqa: E402
from benchmarks.simulator.cpu_calibration import SCHEMA, fit_decode, fit_prefill  # noqa: E402
from benchmarks.tools.local_server import LocalServer, start_all  # noqa: E402
from benchmarks.tools.tiny_model import ensure_tiny_model  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point number group problem fact river stone light paper music garden "
         "system window question answer market energy silver forest engine letter").split()
PREFILL_TARGETS = (16, 48, 96, 192, 320, 480)  # prompt tokens: bench_node's range (22-419)
HIT_BASES = (96, 256, 448)  # cached prefix before a 48-token follow-up
DECODE_PROMPTS = (24, 200, 400)
DECODE_TOKENS = 32
DEFAULT_OUT = Path("runs/calibration/cpu.json")


def synthetic(tokenizer, tokens: int, seed: int) -> str:
    """Seeded random words, grown until they tokenize to at least `tokens` tokens."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words)).ids) < tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words)


async def _streamed(http, url, messages, max_tokens) -> RequestRecord:
    rec = RequestRecord(session="calibration", turn=0, server=url, t_send=0.0)
    await chat(http, url, messages, max_tokens, rec, time.perf_counter())
    if rec.error or rec.ttft is None:
        raise RuntimeError(f"calibration request to {url} failed: {rec.error}")
    return rec


async def timing(http, url: str, tokenizer, repeats: int, first_of: int = 1) -> dict:
    """Prefill points (cold and after a prefix) and decode points of one server. A prefill
    point's request asks for `first_of` tokens: its TTFT is then what a benchmark request
    asking for as many sees (SGLang's overlapped scheduler streams the first token after the
    next forward when more follow, one decode step later than for a 1-token request)."""
    prefill, decode = [], []

    def point(rec):
        prefill.append({"new": rec.prompt_tokens - (rec.cached_tokens or 0),
                        "cached": rec.cached_tokens or 0, "ttft_s": rec.ttft})

    for rep in range(repeats):
        for i, n in enumerate(PREFILL_TARGETS):
            point(await _streamed(http, url, [{"role": "user", "content":
                                               synthetic(tokenizer, n, 1000 * rep + i)}],
                                  first_of))
        for i, n in enumerate(HIT_BASES):
            first = [{"role": "user", "content": synthetic(tokenizer, n, 5000 + 1000 * rep + i)}]
            point(await _streamed(http, url, first, first_of))
            follow = first + [{"role": "assistant", "content": "ok"},
                              {"role": "user", "content":
                               synthetic(tokenizer, 48, 9000 + 1000 * rep + i)}]
            point(await _streamed(http, url, follow, first_of))
    for i, n in enumerate(DECODE_PROMPTS):
        rec = await _streamed(http, url, [{"role": "user", "content":
                                           synthetic(tokenizer, n, 20000 + i)}], DECODE_TOKENS)
        # from the stream's end, not its gaps: a server streams several fast tokens per chunk
        steps = (rec.completion_tokens or DECODE_TOKENS) - 1
        decode.append({"context": rec.prompt_tokens + steps // 2,
                       "step_s": (rec.e2e - rec.ttft) / steps, "steps": steps})
    return {"prefill_points": prefill, "prefill_tokens_asked": first_of,
            "decode_points": decode,
            "prefill_fit": fit_prefill(prefill), "decode_fit": fit_decode(decode)}


async def _ids(http, url: str, messages: list[dict], max_tokens: int) -> tuple[list, list, str]:
    """Greedy answer with its token ids: (prompt ids, answer ids, answer text)."""
    payload = {"model": "default", "messages": messages, "max_tokens": max_tokens,
               "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    async with http.post(url + "/v1/chat/completions", json=payload) as resp:
        body = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"trace request to {url} failed: HTTP {resp.status} {body}")
    ch = body["choices"][0]
    return ch["prompt_token_ids"], ch["response_token_ids"], ch["message"]["content"] or ""


async def _generate_ids(http, url: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy output token ids of a token-id prompt (SGLang's /generate, as bench_node's burst
    sends it)."""
    payload = {"input_ids": prompt_ids, "sampling_params": {
        "max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
    async with http.post(url + "/generate", json=payload) as resp:
        body = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"trace request to {url} failed: HTTP {resp.status} {body}")
    return list(body["output_ids"])


async def conversation_trace(http, url, convs, turns: int, max_tokens: int) -> list[dict]:
    """Turns 1..`turns` of each conversation, history carrying the model's own answers (as
    BusyReplay does); one record per (session, turn)."""
    out = []
    for conv in convs:
        messages: list[dict] = []
        for t in range(turns):
            messages.append({"role": "user", "content": conv.turns[t].user})
            prompt, answer, text = await _ids(http, url, list(messages), max_tokens)
            messages.append({"role": "assistant", "content": text})
            out.append({"session": conv.id, "turn": t + 1, "prompt_ids": prompt,
                        "output_ids": answer})
    return out


def copy_bandwidth(busy: ModelFacts, donor: ModelFacts, busy_cfg: dict, donor_cfg: dict) -> dict:
    """Load and store time of PoolTransferEngine (CPU pool lease) at three sizes, fitted as
    latency + bytes / bandwidth."""
    import torch
    from bench_transfer import Pool, bench_page_size

    from sglang_swift.dataplane import KVGeometry

    def geom(cfg, layers):
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return KVGeometry(layers, cfg["num_key_value_heads"], hd, hd, torch.float32, 1)

    g, dg = geom(busy_cfg, busy.layers), geom(donor_cfg, donor.layers)
    out = []
    for tokens in (64, 256, 1024):  # bench_node's loads: tens to a few hundred tokens
        pool = Pool(g, 4 * tokens, tokens * busy.kv_bytes_per_token)
        r = bench_page_size(g, tokens, 5, 1, pool, time.monotonic() + 10.0, donor=dg)
        out.append({"tokens": tokens, "bytes": r["bytes"],
                    "load_s": r["bytes"] / (r["load_gbps"] * 1e9),
                    "store_s": r["bytes"] / (r["store_gbps"] * 1e9), "verified": r["verified"]})
    if not all(p["verified"] for p in out):
        raise RuntimeError("PoolTransferEngine round trip did not verify; "
                           "the copy figures are void")
    fits = {}
    for kind in ("load", "store"):  # t = latency + bytes / bandwidth
        f = fit_decode([{"context": p["bytes"], "step_s": p[f"{kind}_s"]} for p in out])
        fits[kind] = {"latency_s": f["d0_s"],
                      "bytes_per_s": (1.0 / f["d1_s_per_token"] if f["d1_s_per_token"] > 0
                                      else float("inf"))}
    return {"engine": "PoolTransferEngine (CPU pool lease, 1 thread), "
                      "busy pages packed in donor pages",
            "points": out, "load": fits["load"], "store": fits["store"]}


def host_copy(busy: ModelFacts, busy_cfg: dict, pools: dict[str, tuple[int, float]]) -> dict:
    """Store and load time of the host tier's copies (`HostKV`: SGLang's host pool and its
    transfer methods, the CPU engine's stand-ins) at three sizes, one torch thread as a server's
    scheduler copies; fitted as latency + bytes / bandwidth. `pools`: run -> (device pool
    tokens, --hicache-ratio); the host pool's capacity in tokens for each."""
    import statistics

    from sglang_swift.cpu_compat import activate_in_process

    activate_in_process()  # SGLang's CPU engine and the host pool's CPU copies, in this process
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_swift.integration.host_tier import HostKV

    hd = busy_cfg.get("head_dim") or busy_cfg["hidden_size"] // busy_cfg["num_attention_heads"]
    heads = busy_cfg["num_key_value_heads"]

    def host_kv(size: int, ratio: float) -> HostKV:
        pool = MHATokenToKVPool(size=size, page_size=1, dtype=torch.float32, head_num=heads,
                                head_dim=hd, layer_num=busy.layers, device="cpu",
                                enable_memory_saver=False, v_head_dim=hd, start_layer=0,
                                end_layer=busy.layers - 1)
        return HostKV(pool, ratio=ratio, size_gb=0, layout="layer_first", io_backend="kernel",
                      page_size=1)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sizes = (16, 64, 256)
        host = host_kv(max(sizes) + 1, 1.0)  # slot 0 is the device pool's padding slot
        out = []
        for tokens in sizes:
            dev, slots = torch.arange(1, tokens + 1), torch.arange(tokens)
            store, load = [], []
            for _ in range(15):
                t = time.perf_counter()
                host.store(dev, slots)
                store.append(time.perf_counter() - t)
                t = time.perf_counter()
                for layer in range(host.num_layers):
                    host.load_layer(slots, dev, layer)
                load.append(time.perf_counter() - t)
            out.append({"tokens": tokens, "bytes": tokens * host.token_bytes,
                        "store_s": statistics.median(store), "load_s": statistics.median(load)})
        capacity = {run: host_kv(p, r).capacity for run, (p, r) in pools.items()}
    finally:
        torch.set_num_threads(threads)
    fits = {}
    for kind in ("load", "store"):
        f = fit_decode([{"context": p["bytes"], "step_s": p[f"{kind}_s"]} for p in out])
        fits[kind] = {"latency_s": f["d0_s"],
                      "bytes_per_s": (1.0 / f["d1_s_per_token"] if f["d1_s_per_token"] > 0
                                      else float("inf"))}
    return {"engine": "HostKV over SGLang's MHATokenToKVPoolHost (layer_first, io kernel; the "
                      "CPU engine's copies), store all layers, load layer by layer, 1 thread",
            "points": out, "load": fits["load"], "store": fits["store"],
            "capacity_tokens": capacity}


async def tiers_trace(http, replay_url: str, ids_url: str, convs, plan) -> dict:
    """bench_tiers' busy prompts as its runs send them. Every run's histories carry run (r)'s
    answers (stock SGLang, the plan's device pool: an answer may be cut, a prompt refused), so
    run (r) is replayed here through bench_tiers' own turn loop (`runner._turns`, streamed chat,
    no forced answers) on a server with run (r)'s busy arguments (`replay_url`); then every
    prompt, the history it sent, goes to the unlimited server (`ids_url`) for its token ids and
    the greedy answer's (`return_token_ids`; a prompt (r) refused is still sent by the upper
    bound's larger pool). One record per (session, turn), turn by turn as bench_tiers sends
    them, with what the replay's server did (`replay`: served, prompt and answer tokens) and
    whether the unlimited server's answer agrees with the replay's (`answer_agrees`: the same
    text, or its start where the replay's was cut; None where refused)."""
    from benchmarks.tiers import runner

    records, histories = [], [[] for _ in convs]
    await runner._turns(http, replay_url, convs, histories, 0, plan.turns, plan, None, records,
                        time.perf_counter())
    by = {(r.session, r.turn): r for r in records}
    out = []
    for t in range(plan.turns):
        for conv, msgs in zip(convs, histories):
            if t >= len(conv.turns):
                continue
            prompt, answer, text = await _ids(http, ids_url, msgs[:2 * t + 1], plan.max_tokens)
            rec = by[(conv.id, t + 1)]
            served = rec.ttft is not None
            cut = served and (rec.completion_tokens or 0) < plan.max_tokens
            agrees = (None if not served
                      else text.startswith(rec.text) if cut else text == rec.text)
            out.append({"session": conv.id, "turn": t + 1, "prompt_ids": prompt,
                        "output_ids": answer, "answer_agrees": agrees,
                        "replay": {"served": served, "prompt_tokens": rec.prompt_tokens,
                                   "completion_tokens": rec.completion_tokens,
                                   "cached_tokens": rec.cached_tokens}})
    checked = [r["answer_agrees"] for r in out if r["answer_agrees"] is not None]
    return {"busy": out,
            "source": "bench_tiers run (r) replayed through benchmarks/tiers/runner._turns on "
                      "its busy server's arguments; token ids of each prompt it sent and of the "
                      "greedy answer from an unlimited server",
            "answers_agree": f"{sum(checked)}/{len(checked)}"}


async def drive_tiers(busy: LocalServer, replay: LocalServer, convs, plan, tokenizer,
                      repeats: int) -> dict:
    """bench_tiers' side: the busy server timed alone (the replay server idles, as bench_tiers'
    donor does), then bench_tiers' prompts traced (`tiers_trace`)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        # timed as bench_tiers asks: its requests want plan.max_tokens tokens each
        busy_timing = await timing(http, busy.base_url, tokenizer, repeats,
                                   first_of=plan.max_tokens)
        trace = await tiers_trace(http, replay.base_url, busy.base_url, convs, plan)
    return {"timing": {"busy": busy_timing}, "trace": trace}


async def drive(busy: LocalServer, donor: LocalServer, traffic, plan: NodePlan, tokenizer,
                repeats: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        async def donor_side():
            t = await timing(http, donor.base_url, tokenizer, repeats)
            turns = -(-plan.donor_requests // plan.donor_conversations)
            light = await conversation_trace(http, donor.base_url, traffic.donor, turns,
                                             plan.donor_max_tokens)
            burst = []
            for i, ids in enumerate(traffic.burst):  # token ids, sent as bench_node sends them
                a = await _generate_ids(http, donor.base_url, list(ids), plan.burst_max_tokens)
                burst.append({"session": f"burst-{i}", "turn": 1, "prompt_ids": list(ids),
                              "output_ids": a})
            return t, light, burst

        busy_timing, (donor_timing, light, burst) = await asyncio.gather(
            timing(http, busy.base_url, tokenizer, repeats), donor_side())
        busy_trace = await conversation_trace(http, busy.base_url, traffic.busy, plan.turns + 1,
                                              plan.max_tokens)
    return {"timing": {"busy": busy_timing, "donor": donor_timing},
            "trace": {"busy": busy_trace, "donor": light, "burst": burst}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="default %(default)s (--bench tiers: cpu_tiers.json beside it)")
    ap.add_argument("--plan", choices=("quick", "full"), default="quick",
                    help="which bench_node plan's traffic to trace (its --quick or default run)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the prefill prompts")
    ap.add_argument("--bench", choices=("node", "tiers"), default="node",
                    help="which benchmark's servers and traffic: bench_node (default) or "
                         "bench_tiers (adds the host tier's copies)")
    a = ap.parse_args(argv)
    if a.bench == "tiers":
        return tiers_main(a, argv)
    started = time.monotonic()
    plan = NodePlan.quick() if a.plan == "quick" else NodePlan()
    paths = {"busy": ensure_tiny_model(shape="small"), "donor": ensure_tiny_model(shape="tiny")}
    facts = {r: ModelFacts.from_dir(p) for r, p in paths.items()}
    cfgs = {r: json.loads((p / "config.json").read_text()) for r, p in paths.items()}
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(paths["donor"] / "tokenizer.json"))
    traffic = build_traffic(plan, paths["donor"] / "tokenizer.json")
    env = {**os.environ, "OMP_NUM_THREADS": str(plan.server_threads)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    servers = {r: LocalServer(paths[r], swiftcache=False, max_total_tokens=8192,
                              extra_args=list(COMMON_ARGS), env=env, startup_timeout_s=600,
                              log_path=a.out.parent / f"calibrate-{r}.log") for r in paths}
    load_before = os.getloadavg()
    try:
        start_all(list(servers.values()))
        t_ready = time.monotonic()
        measured = asyncio.run(drive(servers["busy"], servers["donor"], traffic, plan, tokenizer,
                                     a.repeats))
        measure_s = time.monotonic() - t_ready
    finally:
        for s in servers.values():
            s.stop()
    copy = copy_bandwidth(facts["busy"], facts["donor"], cfgs["busy"], cfgs["donor"])
    models = {}
    for role in ("busy", "donor"):
        f = facts[role]
        models[role] = {"name": f.name, "layers": f.layers,
                        "kv_bytes_per_token": f.kv_bytes_per_token,
                        **measured["timing"][role]}
    out = {"schema": SCHEMA,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "scripts/calibrate_cpu.py "
                      + " ".join(argv if argv is not None else sys.argv[1:]),
           "plan": plan.__dict__, "plan_name": a.plan, "models": models, "copy": copy,
           "trace": measured["trace"], "server_threads": plan.server_threads,
           "startup_s": {r: s.startup_s for r, s in servers.items()},
           "measure_s": round(measure_s, 1),
           "loadavg_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
           "wall_s": round(time.monotonic() - started, 1), "cpu_count": os.cpu_count()}
    a.out.write_text(json.dumps(out, indent=1))
    for role, m in models.items():
        p, d = m["prefill_fit"], m["decode_fit"]
        print(f"{role:<6}{m['name']:<12} prefill {p['a_s'] * 1e3:.1f} ms "
              f"+ {p['b_s_per_token'] * 1e3:.3f} ms/token "
              f"+ {p['c_s_per_token_ctx'] * 1e6:.4f} us/token/ctx; "
              f"decode {d['d0_s'] * 1e3:.1f} ms "
              f"+ {d['d1_s_per_token'] * 1e6:.2f} us/ctx token")
    for kind in ("load", "store"):
        print(f"copy  {kind} {copy[kind]['latency_s'] * 1e3:.2f} ms "
              f"+ bytes / {copy[kind]['bytes_per_s'] / 1e9:.2f} GB/s")
    print(f"trace {len(out['trace']['busy'])} busy, {len(out['trace']['donor'])} donor, "
          f"{len(out['trace']['burst'])} burst requests; "
          f"wall {out['wall_s']} s, load {out['loadavg_1min']}")
    print(f"wrote {a.out}")
    print(json.dumps({k: out[k] for k in ("date", "wall_s", "loadavg_1min")}))
    return 0


def tiers_main(a: argparse.Namespace, argv) -> int:
    """bench_tiers' node: its busy server's costs, its traffic's tokens, the host tier's copies
    and the donor-tier copies (both models' geometries, as for bench_node)."""
    from benchmarks.tiers.plan import FULL, QUICK, servers
    from benchmarks.workloads.sharegpt import load_conversations

    started = time.monotonic()
    plan = QUICK if a.plan == "quick" else FULL
    out_path = a.out if a.out != DEFAULT_OUT else DEFAULT_OUT.with_name("cpu_tiers.json")
    paths = {"busy": ensure_tiny_model(shape="small"), "donor": ensure_tiny_model(shape="tiny")}
    facts = {r: ModelFacts.from_dir(p) for r, p in paths.items()}
    cfgs = {r: json.loads((p / "config.json").read_text()) for r, p in paths.items()}
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(paths["busy"] / "tokenizer.json"))
    convs = load_conversations(plan.conversations, min_turns=plan.turns,
                               max_chars_per_message=plan.max_chars)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    busy = LocalServer(paths["busy"], swiftcache=False, max_total_tokens=8192,
                       extra_args=list(COMMON_ARGS), startup_timeout_s=600,
                       log_path=out_path.parent / "calibrate-tiers-busy.log")
    r_spec = servers("r", plan, paths["busy"], paths["donor"], "", facts["busy"],
                     facts["donor"])["busy"]  # run (r)'s busy server, as bench_tiers starts it
    replay = LocalServer(r_spec.model, swiftcache=r_spec.swiftcache,
                         max_total_tokens=r_spec.pool, extra_args=list(r_spec.args),
                         startup_timeout_s=600,
                         log_path=out_path.parent / "calibrate-tiers-replay.log")
    load_before = os.getloadavg()
    try:
        start_all([busy, replay])
        t_ready = time.monotonic()
        measured = asyncio.run(drive_tiers(busy, replay, convs, plan, tokenizer, a.repeats))
        measure_s = time.monotonic() - t_ready
    finally:
        busy.stop()
        replay.stop()
    copy = copy_bandwidth(facts["busy"], facts["donor"], cfgs["busy"], cfgs["donor"])
    own = (plan.busy_pool, plan.host_ratio)  # (h) and (s); the upper bound (u) has no host tier
    host = host_copy(facts["busy"], cfgs["busy"], {"h": own, "s": own})
    models = {r: {"name": f.name, "layers": f.layers, "kv_bytes_per_token": f.kv_bytes_per_token,
                  "context_len": cfgs[r].get("max_position_embeddings")}
              for r, f in facts.items()}
    models["busy"].update(measured["timing"]["busy"])
    out = {"schema": SCHEMA, "bench": "tiers",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "scripts/calibrate_cpu.py "
                      + " ".join(argv if argv is not None else sys.argv[1:]),
           "plan": plan.__dict__, "plan_name": a.plan, "models": models, "copy": copy,
           "host_copy": host, "trace": measured["trace"],
           "server_threads": os.environ.get("OMP_NUM_THREADS", "unset (torch's default)"),
           "startup_s": {"busy": busy.startup_s, "replay": replay.startup_s},
           "measure_s": round(measure_s, 1),
           "loadavg_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
           "wall_s": round(time.monotonic() - started, 1), "cpu_count": os.cpu_count()}
    out_path.write_text(json.dumps(out, indent=1))
    p, d = models["busy"]["prefill_fit"], models["busy"]["decode_fit"]
    print(f"busy  {models['busy']['name']:<12} prefill {p['a_s'] * 1e3:.1f} ms "
          f"+ {p['b_s_per_token'] * 1e3:.3f} ms/token "
          f"+ {p['c_s_per_token_ctx'] * 1e6:.4f} us/token/ctx; "
          f"decode {d['d0_s'] * 1e3:.1f} ms + {d['d1_s_per_token'] * 1e6:.2f} us/ctx token")
    for name, c in (("donor copy", copy), ("host copy", host)):
        for kind in ("load", "store"):
            print(f"{name} {kind} {c[kind]['latency_s'] * 1e3:.3f} ms "
                  f"+ bytes / {c[kind]['bytes_per_s'] / 1e9:.2f} GB/s")
    print(f"host capacity tokens {host['capacity_tokens']}")
    refused = sum(1 for t in out["trace"]["busy"] if not t["replay"]["served"])
    print(f"trace {len(out['trace']['busy'])} busy requests (run (r) replayed: {refused} "
          f"refused, answers agree {out['trace']['answers_agree']}); wall {out['wall_s']} s, "
          f"load {out['loadavg_1min']}")
    print(f"wrote {out_path}")
    print(json.dumps({k: out[k] for k in ("date", "wall_s", "loadavg_1min")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
