"""Scenarios (machines, models, traffic) and one simulated run of one system at one load point.

Systems compared on the same trace (same sessions, same arrival times):
  sglang-radix    device radix cache only; misses recomputed
  sglang-hicache  + host tier over PCIe (hicache_ratio x device), layer-wise load overlapped
  vllm-offload    + host tier over PCIe, same size, the load finishes before the request is scheduled
  swiftcache      + donor HBM over NVLink (leased through the donor ledger), then the host tier
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from sglang_swift.integration.swift_config import SwiftConfig

from . import params
from .cache_adapter import TreeCache
from .node import Node
from .roofline import Roofline
from .server import ModelServer, SimRequest
from ..workloads.specs import AgentWorkload, Arrivals, ChatWorkload
from ..workloads.token_traces import agent_traces, chat_traces, page_ids

SYSTEMS = {
    "sglang-radix": dict(load_mode="none", host=False, donor=False),
    "sglang-hicache": dict(load_mode="layerwise", host=True, donor=False),
    "vllm-offload": dict(load_mode="before", host=True, donor=False),
    "swiftcache": dict(load_mode="layerwise", host=True, donor=True),
    # sensitivity, not a product configuration: HiCache with a host tier as large as SwiftCache's
    # donor + host tiers together, to separate the bandwidth effect from the capacity effect
    "sglang-hicache-bighost": dict(load_mode="layerwise", host="big", donor=False),
}
MAIN_SYSTEMS = ("sglang-radix", "sglang-hicache", "vllm-offload", "swiftcache")


@dataclass(frozen=True)
class Scenario:
    name: str
    gpu: str
    master: str
    donors: tuple[str, ...]
    workload: str = "chat"  # master workload: chat | agent | single (first turns only)
    donor_rate: float = 0.05  # donor chat sessions/s each ("lighter traffic")
    think_mean_s: float = 10.0
    # Half of each donor's KV pool: SwiftConfig's default until commit d8ed00e, which made the
    # default 0 ("set it to what the device has idle"); docs/simulation.md shows 0.25 and 0.75 too.
    lend_fraction: float = 0.5
    watermark: float = SwiftConfig().reclaim_watermark
    drain_s: float = 1800.0  # stop this long after the last arrival (unfinished requests are counted)


PAPER = Scenario("paper-4xH20", "H20", "Qwen3-32B", ("Qwen3-14B", "Qwen3-8B", "Qwen3-4B"))
# Qwen3-32B at TP=1 leaves ~1.3 GB of KV on an 80 GB H100 after SGLang's reserve, so the H100
# node's high-demand model is Qwen3-14B (the simulator has no tensor parallelism).
HGX_H100 = Scenario("8xH100", "H100", "Qwen3-14B",
                    ("Qwen3-8B", "Qwen3-8B", "Qwen3-4B", "Qwen3-4B", "Qwen3-4B", "Qwen3-1.7B", "Qwen3-1.7B"))
HGX_H200 = Scenario("8xH200", "H200", "Qwen3-32B",
                    ("Qwen3-14B", "Qwen3-8B", "Qwen3-8B", "Qwen3-4B", "Qwen3-4B", "Qwen3-1.7B", "Qwen3-1.7B"))
SCENARIOS = {s.name: s for s in (PAPER, HGX_H100, HGX_H200)}


def _server(node, g, name, model_name, scn, mode, host, donor) -> ModelServer:
    m = params.MODELS[model_name]
    hw = params.gpu(scn.gpu)
    page = int(params.SGLANG["page_size"].value)
    pages = int(params.kv_pool_bytes(scn.gpu, m) // (page * m.kv_bytes_per_token))
    host_pages = int(params.SGLANG["hicache_ratio"].value * pages) if host else 0
    if host == "big":
        from .capacity import lendable_bytes

        host_pages += int(lendable_bytes(scn, scn.lend_fraction) // (page * m.kv_bytes_per_token))
    rl = Roofline(m, hw["bf16_flops"], hw["hbm_bw"], params.EFFICIENCY["compute"].value,
                  params.EFFICIENCY["hbm"].value)
    cache = TreeCache(pages, host_pages, donor=donor)
    srv = ModelServer(name, node.gpus[g], rl, cache, page_tokens=page,
                      chunk=int(params.SGLANG["chunked_prefill_size"].value),
                      max_running=int(params.SGLANG["max_running_requests"].value), load_mode=mode, node=node)
    node.gpus[g].server = srv
    node.by_name[name] = srv
    return srv


def _drive(node, srv, sessions, page, stop_at) -> list[SimRequest]:
    reqs: list[SimRequest] = []
    rid = [0]

    def submit(s, k, ctx):
        if k >= len(s.turns) or node.loop.now > stop_at:
            return
        t = s.turns[k]
        prompt = ctx + t.new_tokens
        r = SimRequest(rid[0], str(s.sid), k, node.loop.now, prompt, t.output_tokens,
                       key_prompt=_arr(page_ids(s, prompt - 1, page)),
                       key_full=_arr(page_ids(s, prompt + t.output_tokens, page)))
        rid[0] += 1
        r.on_done = lambda r, s=s, k=k, t=t, prompt=prompt: node.loop.after(
            t.think_s, lambda: submit(s, k + 1, prompt + t.output_tokens))
        reqs.append(r)
        srv.submit(r)

    for s in sessions:
        node.loop.at(s.start, lambda s=s: submit(s, 0, 0))
    return reqs


def _arr(xs):
    from array import array

    return array("q", xs)


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def metrics(reqs: list[SimRequest], end: float) -> dict:
    done = [r for r in reqs if r.first_token is not None]
    # requests still without a first token at the end count with their waiting time so far
    ttft = [r.ttft for r in done] + [end - r.arrival for r in reqs if r.first_token is None and not r.rejected]
    tpot = [float(np.mean(r.itls)) for r in done if r.itls]
    prompt = sum(r.prompt_tokens for r in done)
    hit = {}
    for r in done:
        for tier, n in r.hit_tokens.items():
            hit[tier] = hit.get(tier, 0) + n
    loads = [r.load_time for r in done if r.load_time is not None]
    return {
        "requests": len(reqs), "first_token": len(done), "rejected": sum(r.rejected for r in reqs),
        "ttft_p50": _pct(ttft, 50), "ttft_p90": _pct(ttft, 90), "ttft_p99": _pct(ttft, 99),
        "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99),
        "hit_rate": {k: v / prompt for k, v in hit.items()} if prompt else {},
        "load_p99": _pct(loads, 99), "loads": len(loads),
    }


def _stable(queue: list[tuple[float, int]], window: float) -> bool:
    """Not overloaded: the waiting queue in the last quarter of the arrival window is on average
    no longer than twice that of the second quarter plus 2 requests (it is not growing)."""
    def mean(lo, hi):
        xs = [n for t, n in queue if lo <= t < hi]
        return sum(xs) / len(xs) if xs else 0.0
    return mean(0.75 * window, window) <= 2 * mean(0.25 * window, 0.5 * window) + 2


@dataclass
class RunResult:
    system: str
    rate: float
    master: dict
    donors: dict = field(default_factory=dict)
    lent_blocks: int = 0
    reclaimed_blocks: int = 0
    bytes_by_route: dict = field(default_factory=dict)
    tree_calls: dict = field(default_factory=dict)
    events: int = 0


# The traffic of the simulated node (stated choices, docs/simulation.md section 2): chat keeps up to 16
# turns of each conversation and thinks for the scenario's mean time; agent answers are 16-128 tokens,
# tool calls take 2 s on average, and all sessions are one agent type, so they share a system prompt.
MAX_CHAT_TURNS = 16
AGENT = AgentWorkload(output_min=16, output_max=128, tool_latency_mean_s=2.0, shared_system_prompt=True)
AGENT_SEED_OFFSET = 17  # agent traces draw apart from the chat traces of the same seed


def master_sessions(scn: Scenario, rate: float, window: float, seed: int):
    arrivals = Arrivals(rate=rate, window_s=window)
    if scn.workload == "agent":
        return agent_traces(replace(AGENT, seed=seed + AGENT_SEED_OFFSET), arrivals)
    # "single" is low reuse: first turns only, nothing to reuse across turns
    turns = 1 if scn.workload == "single" else MAX_CHAT_TURNS
    return chat_traces(ChatWorkload(max_turns=turns, think_mean_s=scn.think_mean_s, seed=seed), arrivals)


def donor_sessions(scn: Scenario, donor_index: int, rate: float, window: float, seed: int):
    """Chat for donor `donor_index` (0-based): other conversations and another seed than the master's."""
    chat = ChatWorkload(max_turns=MAX_CHAT_TURNS, think_mean_s=scn.think_mean_s,
                        conversation_offset=2000 + 500 * donor_index, seed=seed + 101 * (donor_index + 1))
    return chat_traces(chat, Arrivals(rate=rate, window_s=window))


def run_point(scn: Scenario, system: str, rate: float, window: float, *, seed: int = 0,
              with_master: bool = True, with_donors: bool = True, lend: bool | None = None,
              donor_rate: float | None = None) -> RunResult:
    """Simulate `window` seconds of arrivals (then drain) for one system at one master rate."""
    cfg = SYSTEMS[system]
    lend = cfg["donor"] if lend is None else lend
    hw = params.gpu(scn.gpu)
    node = Node(hw["nvlink_bw_dir"], hw["pcie_bw_dir"], 1 + len(scn.donors))
    page = int(params.SGLANG["page_size"].value)
    stop_at = window + scn.drain_s
    master = _server(node, 0, "master", scn.master, scn, cfg["load_mode"], cfg["host"], cfg["donor"])
    donors = []
    if with_donors or lend:
        for i, dm in enumerate(scn.donors):
            donors.append(_server(node, i + 1, f"donor{i + 1}:{dm}", dm, scn, "none", False, False))
    lent = 0
    if lend:
        for d in donors:
            lent += node.lend(d, master, scn.lend_fraction, scn.watermark)
    m_reqs = _drive(node, master, master_sessions(scn, rate, window, seed), page, stop_at) if with_master else []
    d_reqs = {}
    drate = scn.donor_rate if donor_rate is None else donor_rate
    for i, d in enumerate(donors):
        if drate > 0:
            d_reqs[d.name] = _drive(node, d, donor_sessions(scn, i, drate, window, seed), page, stop_at)
    queue: list[tuple[float, int]] = []

    def sample():
        queue.append((node.loop.now, len(master.waiting) + len(master.loading)))
        if node.loop.now + window / 40 < window:
            node.loop.after(window / 40, sample)

    node.loop.at(0.0, sample)
    node.loop.run(until=stop_at)
    end = node.loop.now
    mm = metrics(m_reqs, end) if with_master else {}
    if with_master:
        mm["stable"] = _stable(queue, window)
        mm["load_failures"] = master.load_failures
    res = RunResult(system, rate, mm,
                    {k: metrics(v, end) for k, v in d_reqs.items()}, lent,
                    sum(d.reclaimed_blocks for d in node.donations.values()),
                    {f"{a}->{b}": v for (a, b), v in node.bytes_by_route.items()},
                    dict(master.cache.calls), node.loop.events_run)
    return res
