"""Closed-loop load (SIMULATED), as SGLang's `benchmark/hicache/bench_multiturn.py` applies it.

A fixed set of clients, each a conversation of `rounds` requests: round k's prompt is the
client's history (every earlier prompt and answer) plus `request_length` new tokens, answered with
`output_length` tokens. Clients whose next round is due wait in a ready queue (picked at random,
or first in first out); at most `max_parallel` requests are in flight, and a finite
`request_rate` spaces the sends by exponential gaps. A client's next round joins the queue when
its answer arrives. The load is bounded by the clients, not by an arrival process, so an
overloaded server slows its clients instead of growing a queue without end.

Concurrency is stated against HiCache's capacity: the clients whose final histories together
fill HiCache's device pool plus host tier (`capacity_clients`).
"""

from __future__ import annotations

import math
import random
from array import array
from dataclasses import dataclass

import numpy as np

from . import params
from .capacity import PAGE_TOKENS, master_tier_pages
from .node import Node
from .scenario import SYSTEMS, Scenario, _server
from .server import SimRequest

CLIENT_KEY_BASE = 10_000_000  # client c's page p has radix key (c + 1) * base + p


@dataclass(frozen=True)
class ClosedLoop:
    clients: int
    rounds: int = 10
    request_length: int = 2048
    output_length: int = 1
    max_parallel: int = 4
    request_rate: float = math.inf  # requests/s; inf: send whenever a slot and a client are free
    ready_queue_policy: str = "random"  # random | fifo
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.clients, self.rounds, self.request_length, self.output_length,
               self.max_parallel) < 1:
            raise ValueError("clients, rounds, request_length, output_length and max_parallel "
                             "must each be >= 1")
        if self.ready_queue_policy not in ("random", "fifo"):
            raise ValueError(f"ready_queue_policy {self.ready_queue_policy!r}: random or fifo")
        if self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0 (inf: unpaced), got {self.request_rate}")

    @property
    def history_tokens(self) -> int:
        """A client's prompt plus answer after its last round."""
        return self.rounds * (self.request_length + self.output_length)


def capacity_clients(scn: Scenario, cl: ClosedLoop) -> float:
    """Clients whose final histories together fill HiCache's device pool plus host tier."""
    pages = master_tier_pages(scn, True, False)
    return (pages["device"] + pages["host"]) * PAGE_TOKENS / cl.history_tokens


def _keys(client: int, tokens: int) -> array:
    base = (client + 1) * CLIENT_KEY_BASE
    return array("q", range(base, base + tokens // PAGE_TOKENS))


def run(scn: Scenario, system: str, cl: ClosedLoop) -> dict:
    """Every round of every client through the busy model's server under `system` (donors
    idle, lending as the system does); P99 TTFT, cached tokens and hits by tier."""
    cfg = SYSTEMS[system]
    hw = params.gpu(scn.gpu)
    node = Node(hw["nvlink_bw_dir"], scn.pcie_bw or hw["pcie_bw_dir"], 1 + len(scn.donors))
    srv = _server(node, 0, "master", scn.master, scn, cfg["load_mode"], cfg["host"],
                  cfg["donor"], cfg.get("ideal", False))
    if cfg["donor"]:
        for i, dm in enumerate(scn.donors):
            d = _server(node, i + 1, f"donor{i + 1}:{dm}", dm, scn, "none", False, False)
            node.lend(d, srv, scn.lend_fraction, scn.watermark)
    rng = random.Random(cl.seed)
    ready = list(range(cl.clients))
    rounds = [0] * cl.clients
    state = {"in_flight": 0, "next_send": 0.0, "rid": 0}
    reqs: list[SimRequest] = []
    step = cl.request_length + cl.output_length

    def send(c: int) -> None:
        k = rounds[c]
        prompt = k * step + cl.request_length
        r = SimRequest(state["rid"], str(c), k, node.loop.now, prompt, cl.output_length,
                       key_prompt=_keys(c, prompt - 1),
                       key_full=_keys(c, prompt + cl.output_length))
        state["rid"] += 1
        state["in_flight"] += 1
        r.on_done = lambda r, c=c: finished(c)
        reqs.append(r)
        srv.submit(r)

    def pump() -> None:
        while state["in_flight"] < cl.max_parallel and ready:
            if node.loop.now < state["next_send"]:
                node.loop.at(state["next_send"], pump)
                return
            c = ready.pop(rng.randrange(len(ready)) if cl.ready_queue_policy == "random" else 0)
            send(c)
            if math.isfinite(cl.request_rate):
                state["next_send"] = node.loop.now + rng.expovariate(cl.request_rate)

    def finished(c: int) -> None:
        state["in_flight"] -= 1
        rounds[c] += 1
        if rounds[c] < cl.rounds:
            ready.append(c)
        node.loop.after(0.0, pump)

    node.loop.at(0.0, pump)
    node.loop.run()
    done = [r for r in reqs if r.first_token is not None]
    if len(done) != cl.clients * cl.rounds:
        raise RuntimeError(f"{system}: {len(done)} of {cl.clients * cl.rounds} requests answered "
                           f"({sum(r.rejected for r in reqs)} rejected: a history longer than "
                           f"the device pool)")
    prompt = sum(r.prompt_tokens for r in done)
    hits: dict[str, int] = {}
    for r in done:
        for tier, n in r.hit_tokens.items():
            hits[tier] = hits.get(tier, 0) + n
    ttft = [r.ttft for r in done]
    return {"system": system, "requests": len(done),
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
            "cached_tokens": sum(hits.values()), "prompt_tokens": prompt,
            "hits_by_tier": {t: round(n / prompt, 4) for t, n in sorted(hits.items())},
            "makespan_s": max(r.finish for r in done)}


def sweep(scn: Scenario, base: ClosedLoop, multiples, systems=("sglang-hicache", "swiftcache",
                                                                 "ideal")) -> dict:
    """Each multiple of HiCache's capacity as a number of clients, every system at each."""
    cap = capacity_clients(scn, base)
    points = []
    for m in multiples:
        clients = max(1, round(m * cap))
        cl = ClosedLoop(clients, base.rounds, base.request_length, base.output_length,
                        base.max_parallel, base.request_rate, base.ready_queue_policy, base.seed)
        by = {s: run(scn, s, cl) for s in systems}
        h = by["sglang-hicache"]
        points.append({"multiple": m, "clients": clients, "systems": by,
                       "p99_ttft_reduction_vs_hicache": {
                           s: round(1 - by[s]["ttft_p99"] / h["ttft_p99"], 4) for s in systems
                           if s != "sglang-hicache"},
                       "cached_vs_hicache": {
                           s: (round(by[s]["cached_tokens"] / h["cached_tokens"], 4)
                               if h["cached_tokens"] else None)
                           for s in systems if s != "sglang-hicache"}})
    return {"capacity_clients": cap, "points": points}
