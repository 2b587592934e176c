"""Scenarios (machines, models, traffic) and one simulated run of one system at one load point.

Systems compared on the same trace (same sessions, same arrival times):
  sglang-radix    device radix cache only; misses recomputed
  sglang-hicache  + host tier over PCIe (hicache_ratio x device), layer-wise load overlapped
  vllm-offload    + host tier over PCIe, same size, the load finishes before the request is
                  scheduled
  swiftcache      + donor HBM over NVLink (leased through the donor ledger), then the host tier
  sglang-hicache-bighost  HiCache whose host tier is as large as SwiftCache's donor + host tiers
                  (the equal-memory baseline: it separates bandwidth from capacity)
  ideal           HiCache with the donor lease held in its own device pool (the same host tier):
                  what the lent memory is worth with no link and no lease
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, replace

from sglang_swift.config import SwiftConfig

from ..workloads.specs import AgentWorkload, Arrivals, ChatWorkload
from ..workloads.token_traces import agent_traces, chat_traces, page_ids
from . import params
from .cache_adapter import TreeCache
from .capacity import PAGE_TOKENS, device_pages, master_tier_pages, page_bytes
from .node import Node
from .roofline import Roofline
from .run_metrics import metrics, stable
from .server import ModelServer, SimRequest

SYSTEMS = {
    "sglang-radix": dict(load_mode="none", host=False, donor=False),
    "sglang-hicache": dict(load_mode="layerwise", host=True, donor=False),
    "vllm-offload": dict(load_mode="before", host=True, donor=False),
    "swiftcache": dict(load_mode="layerwise", host=True, donor=True),
    "sglang-hicache-bighost": dict(load_mode="layerwise", host="big", donor=False),
    "ideal": dict(load_mode="layerwise", host=True, donor=False, ideal=True),
}
MAIN_SYSTEMS = ("sglang-radix", "sglang-hicache", "vllm-offload", "swiftcache")


@dataclass(frozen=True)
class Scenario:
    name: str
    gpu: str
    master: str
    donors: tuple[str, ...]
    workload: str = "chat"  # master workload: chat | agent | single (first turns only)
    # chat sessions/s of each donor's own traffic, in `donors` order; () leaves every donor idle.
    # The experiments set them to a share of each donor's own goodput (experiments.donor_rates).
    donor_rates: tuple[float, ...] = ()
    think_mean_s: float = 10.0
    # Half of each donor's KV pool, a stated choice: SwiftConfig lends nothing unless an operator
    # sets lend_fraction (its default is 0); docs/simulation.md shows 0.25 and 0.75 too.
    lend_fraction: float = 0.5
    watermark: float = SwiftConfig().reclaim_watermark
    # stop this long after the last arrival (unfinished requests are counted)
    drain_s: float = 1800.0
    # The regime knobs (docs/simulation.md section 9); the defaults are the headline's.
    min_turns: int = 1  # chat: conversations with fewer turns are skipped
    host_bytes: float | None = None  # HiCache's host tier; None: hicache_ratio x device
    pcie_bw: float | None = None  # effective PCIe bandwidth per direction; None: the GPU's
    tool_latency_s: float = 2.0  # agent: mean tool time between a turn and the next
    donor_think_s: float = 10.0  # the donors' own chat (their traffic is not a regime knob)
    write_through: bool = False  # --hicache-write-policy write_through (else write_back)


PAPER = Scenario("paper-4xH20", "H20", "Qwen3-32B", ("Qwen3-14B", "Qwen3-8B", "Qwen3-4B"))
# Qwen3-32B at TP=1 leaves ~1.3 GB of KV on an 80 GB H100 after SGLang's reserve, so the H100
# node's high-demand model is Qwen3-14B (the simulator has no tensor parallelism).
HGX_H100 = Scenario("8xH100", "H100", "Qwen3-14B",
                    ("Qwen3-8B", "Qwen3-8B", "Qwen3-4B", "Qwen3-4B", "Qwen3-4B", "Qwen3-1.7B",
                     "Qwen3-1.7B"))
HGX_H200 = Scenario("8xH200", "H200", "Qwen3-32B",
                    ("Qwen3-14B", "Qwen3-8B", "Qwen3-8B", "Qwen3-4B", "Qwen3-4B", "Qwen3-1.7B",
                     "Qwen3-1.7B"))
SCENARIOS = {s.name: s for s in (PAPER, HGX_H100, HGX_H200)}


def master_memory_bytes(scn: Scenario, system: str) -> dict[str, float]:
    """Bytes of the high-demand model's KV cache per tier (device, donor, host) under `system`:
    exactly what `run_point` gives it (the donor lease is what `Node.lend` grants)."""
    cfg = SYSTEMS[system]
    pages = master_tier_pages(scn, cfg["host"], cfg["donor"], cfg.get("ideal", False))
    return {tier: n * page_bytes(scn.master) for tier, n in pages.items()}


def donor_name(scn: Scenario, index: int) -> str:
    """The server name of donor `index` (0-based) in run results: "donor<index+1>:<model>"."""
    return f"donor{index + 1}:{scn.donors[index]}"


def _server(node, g, name, model_name, scn, mode, host, donor, ideal=False) -> ModelServer:
    m = params.MODELS[model_name]
    hw = params.gpu(scn.gpu)
    if g == 0:  # the high-demand model
        pages = master_tier_pages(scn, host, donor, ideal)
        dev, host_pages = pages["device"], pages["host"]
    else:  # a donor: its own pool, no lower tiers
        dev, host_pages = device_pages(scn.gpu, model_name), 0
    rl = Roofline(m, hw["bf16_flops"], hw["hbm_bw"], params.EFFICIENCY["compute"].value,
                  params.EFFICIENCY["hbm"].value)
    cache = TreeCache(dev, host_pages, donor=donor,
                      write_through=scn.write_through and host_pages > 0)
    srv = ModelServer(name, node.gpus[g], rl, cache, page_tokens=PAGE_TOKENS,
                      chunk=int(params.SGLANG["chunked_prefill_size"].value),
                      max_running=int(params.SGLANG["max_running_requests"].value),
                      load_mode=mode, node=node)
    # write-through copies go device -> host on this GPU's link; nothing waits for them (the
    # live server enqueues them on the scheduler's stream ahead of the forward)
    cache.copier = lambda copies: [node.copy(srv, cp, lambda t: None) for cp in copies]
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
                       key_prompt=array("q", page_ids(s, prompt - 1, page)),
                       key_full=array("q", page_ids(s, prompt + t.output_tokens, page)))
        rid[0] += 1
        r.on_done = lambda r, s=s, k=k, t=t, prompt=prompt: node.loop.after(
            t.think_s, lambda: submit(s, k + 1, prompt + t.output_tokens))
        reqs.append(r)
        srv.submit(r)

    for s in sessions:
        node.loop.at(s.start, lambda s=s: submit(s, 0, 0))
    return reqs


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


# The traffic of the simulated node (stated choices, docs/simulation.md section 2): chat keeps up
# to 16 turns of each conversation and thinks for the scenario's mean time; agent answers are
# 16-128 tokens, tool calls take 2 s on average, and all sessions are one agent type, so they
# share a system prompt.
MAX_CHAT_TURNS = 16
AGENT = AgentWorkload(output_min=16, output_max=128, tool_latency_mean_s=2.0,
                      shared_system_prompt=True)
AGENT_SEED_OFFSET = 17  # agent traces draw apart from the chat traces of the same seed


def master_sessions(scn: Scenario, rate: float, window: float, seed: int):
    arrivals = Arrivals(rate=rate, window_s=window)
    if scn.workload == "agent":
        agent = replace(AGENT, seed=seed + AGENT_SEED_OFFSET,
                        tool_latency_mean_s=scn.tool_latency_s,
                        steps_min=max(AGENT.steps_min, scn.min_turns),
                        steps_max=max(AGENT.steps_max, scn.min_turns))
        return agent_traces(agent, arrivals)
    # "single" is low reuse: first turns only, nothing to reuse across turns
    turns = 1 if scn.workload == "single" else MAX_CHAT_TURNS
    return chat_traces(ChatWorkload(max_turns=turns, think_mean_s=scn.think_mean_s, seed=seed,
                                    min_turns=min(scn.min_turns, turns)), arrivals)


def donor_sessions(scn: Scenario, donor_index: int, rate: float, window: float, seed: int):
    """Chat for donor `donor_index` (0-based): other conversations and another seed than the
    master's."""
    chat = ChatWorkload(max_turns=MAX_CHAT_TURNS, think_mean_s=scn.donor_think_s,
                        conversation_offset=2000 + 500 * donor_index,
                        seed=seed + 101 * (donor_index + 1))
    return chat_traces(chat, Arrivals(rate=rate, window_s=window))


def run_point(scn: Scenario, system: str, rate: float, window: float, *, seed: int = 0,
              with_master: bool = True, with_donors: bool = True, lend: bool | None = None,
              donor_rates: tuple[float, ...] | None = None) -> RunResult:
    """Simulate `window` seconds of arrivals (then drain) for one system at one master rate.

    Donors serve `donor_rates` chat sessions/s each (default `scn.donor_rates`; () = idle). Every
    server's metrics carry `stable` (its waiting queue did not grow over the window).
    """
    cfg = SYSTEMS[system]
    lend = cfg["donor"] if lend is None else lend
    drates = scn.donor_rates if donor_rates is None else tuple(donor_rates)
    if drates and len(drates) != len(scn.donors):
        raise ValueError(f"donor_rates has {len(drates)} rates for {len(scn.donors)} donors; "
                         f"give one per donor (in Scenario.donors order) or () for idle donors")
    hw = params.gpu(scn.gpu)
    node = Node(hw["nvlink_bw_dir"], scn.pcie_bw or hw["pcie_bw_dir"], 1 + len(scn.donors))
    stop_at = window + scn.drain_s
    master = _server(node, 0, "master", scn.master, scn, cfg["load_mode"], cfg["host"],
                     cfg["donor"], cfg.get("ideal", False))
    donors = []
    if with_donors or lend:
        for i, dm in enumerate(scn.donors):
            donors.append(_server(node, i + 1, donor_name(scn, i), dm, scn, "none", False, False))
    lent = 0
    if lend:
        for d in donors:
            lent += node.lend(d, master, scn.lend_fraction, scn.watermark)
    m_reqs = (_drive(node, master, master_sessions(scn, rate, window, seed), PAGE_TOKENS, stop_at)
              if with_master else [])
    d_reqs = {}
    for i, d in enumerate(donors):
        if drates and drates[i] > 0:
            d_reqs[d.name] = _drive(node, d, donor_sessions(scn, i, drates[i], window, seed),
                                    PAGE_TOKENS, stop_at)
    watched = ([master] if with_master else []) + [d for d in donors if d.name in d_reqs]
    queues: dict[str, list[tuple[float, int]]] = {s.name: [] for s in watched}

    def sample():
        for s in watched:
            queues[s.name].append((node.loop.now, len(s.waiting) + len(s.loading)))
        if node.loop.now + window / 40 < window:
            node.loop.after(window / 40, sample)

    node.loop.at(0.0, sample)
    node.loop.run(until=stop_at)
    end = node.loop.now
    mm = {}
    if with_master:
        mm = metrics(m_reqs, end)
        mm["stable"] = stable(queues["master"], window)
        mm["load_failures"] = master.load_failures
    dm = {}
    for name, reqs in d_reqs.items():
        dm[name] = metrics(reqs, end)
        dm[name]["stable"] = stable(queues[name], window)
    return RunResult(system, rate, mm, dm, lent,
                     sum(d.reclaimed_blocks for d in node.donations.values()),
                     {f"{a}->{b}": v for (a, b), v in node.bytes_by_route.items()},
                     dict(master.cache.calls), node.loop.events_run)
