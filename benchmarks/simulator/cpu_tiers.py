"""bench_tiers' node as the simulator sees it (SIMULATED figures, for `simulate.py --validate
--tiers`): its runs, sizes and traffic (benchmarks/tiers/plan.py, runner.py) with the parameters
`scripts/calibrate_cpu.py --bench tiers` measured.

The runs (the busy `small` model; the `tiny` donor serves nothing but its burst):
  r  stock: device pool `busy_pool`, no lower tier
  h  HiCache: the same device pool and a host tier of the host pool's capacity for it
     (`--hicache-ratio host_ratio`, as SGLang's host pool sizes it: measured in the calibration)
  s  HiCache + SwiftCache: device, donor pages while lent, host; the donor lends `lend_fraction`
     of its pool (`Node.lend`); after turn `burst_after_turn` of every conversation the donor's
     burst takes back every lent page: the tree revokes them with `rescue` (each donor copy
     with no other copy moves to host where room can be made, as the live reclaim does); the
     donor lends the same blocks again before the next turn when the live run's donor did
     (`relent_after_burst`, in bench_tiers' pause after the burst), else nothing before the end
  u  the upper bound: stock SGLang (no HiCache, no lower tier) whose ONE device pool holds the
     busy device pool, the lent busy tokens and (s)'s host tier together (`upper_bound_pool`,
     as `TierPlan.bound_pool` sizes it live); the donor's pool shrinks by what it lends
A record of bench_tiers' older baseline run (i) (HiCache with the lent tokens added to its device
pool) is not simulated: the live record must hold run (u).
Every tier and rule is the live server's: radix_ext's `RadixTree` with
`TreeConfig(cascade="down", donor_over_host=write_through and donor)` (`TreeCache` with
`donor_to_host`, as the live CPU server builds it), the plan's write policy (`write_back` by
default: a prefix reaches host when it leaves the device), a device eviction demoting to donor
pages first, else host, and a copy pushed out of the full lease moving down into host. Copies
cost what the calibration measured: donor pages through `PoolTransferEngine`, host through
`HostKV` (SGLang's host pool); a donor -> host move (the live server reads the lease's rows, then
writes host rows, on the scheduler thread) at the measured donor load's cost (an assumption: the
read is that load, the host write of the same bytes is not timed apart).
Host segments load in the batch's layer fan-in like donor ones (on the CPU engine the live
server copies them before the forward; at the measured cost, well under a millisecond per
request, the two orders differ by less than the TTFT's noise).
Traffic: the conversations turn by turn, one request at a time, each sent when the previous
stream ended; keys are the traced token ids (cpu_node's rules: prompt published when its
prefill ends, prompt + all but the last answer token when it finishes). The trace holds
bench_tiers' own prompts: every run's histories carry run (r)'s answers, as its server (the
plan's device pool) gave them, so a prompt is the same in every run (scripts/calibrate_cpu.py
--bench tiers replays run (r) through bench_tiers' turn loop). Each run's server applies SGLang's
length rules for its own device pool (`served_tokens`): a prompt too long for the pool is
refused (no first token, nothing cached) and the next request follows, and an answer is cut to
what the pool leaves, so (r), (h) and (s) refuse and cut where the upper bound's larger pool
may not.
"""

from __future__ import annotations

from array import array

from radix_ext import DONOR

from ..loadgen.stats import pct
from .cache_adapter import TreeCache
from .cpu_calibration import CalibratedCompute, CpuModel, compute_for
from .cpu_node import (
    CHUNKED_PREFILL,
    MAX_RUNNING,
    UNLIMITED,
    _bandwidth,
    _record,
    steady_order,
)
from .node import Node
from .server import ModelServer, SimRequest

RUNS = ("r", "h", "s", "u")
NO_CONTEXT_LIMIT = 1 << 30  # a calibration without the model's context length
NAMES = {"r": "stock", "h": "hicache", "s": "hicache+swiftcache", "u": "upper bound"}
RECLAIM_ALL = 1 << 40  # own pages asked back: more than any pool, so every lent block returns


class RevokeRecordingCache(TreeCache):
    """`TreeCache` that keeps each reclaim's `RevokeResult` (what moved to host, what was lost)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.revokes: list = []

    def revoke(self, donor: str, lease_id: int, blocks):
        res = super().revoke(donor, lease_id, blocks)
        self.revokes.append(res)
        return res


def _idle_compute(model: dict) -> CalibratedCompute:
    """The donor's cost model: it serves no request in the simulated runs (its burst is the
    reclaim), so only its geometry matters."""
    zero_prefill = {"a_s": 0.0, "b_s_per_token": 0.0, "c_s_per_token_ctx": 0.0}
    return CalibratedCompute(CpuModel(model["name"], model["layers"], model["kv_bytes_per_token"]),
                             zero_prefill, {"d0_s": 0.0, "d1_s_per_token": 0.0})


def tiers_node(cal: dict) -> Node:
    """Two 'GPUs' (the two server processes). Donor-tier copies as cpu_node's; host copies go
    over the busy side's h2d (loads) and d2h (stores) links at HostKV's measured cost."""
    copy, host = cal["copy"], cal["host_copy"]
    node = Node(UNLIMITED, UNLIMITED, 2,
                copy_latency_s={("donor", "device"): copy["load"]["latency_s"],
                                ("device", "donor"): copy["store"]["latency_s"],
                                ("host", "device"): host["load"]["latency_s"],
                                ("device", "host"): host["store"]["latency_s"],
                                ("donor", "host"): copy["load"]["latency_s"]})
    node.gpus[0].nvl_in.bandwidth = _bandwidth(copy["load"])
    node.gpus[1].nvl_in.bandwidth = _bandwidth(copy["store"])
    node.gpus[0].h2d.bandwidth = _bandwidth(host["load"])
    node.gpus[0].d2h.bandwidth = _bandwidth(host["store"])
    node.gpus[1].d2h.bandwidth = _bandwidth(copy["load"])  # donor -> host: a donor read
    return node


def _lent(cal: dict, plan: dict) -> tuple[int, int]:
    """(donor tokens lent, the same bytes in busy tokens): `TierPlan.lent_busy_tokens`."""
    busy_kv = cal["models"]["busy"]["kv_bytes_per_token"]
    donor_kv = cal["models"]["donor"]["kv_bytes_per_token"]
    lent_donor = int(plan["donor_pool"] * plan["lend_fraction"])
    return lent_donor, lent_donor * donor_kv // busy_kv


def upper_bound_pool(cal: dict, plan: dict) -> int:
    """Run (u)'s one device pool, as `TierPlan.bound_pool` sizes it live: the busy device pool,
    the lent busy tokens and the host tier, the larger of SGLang's sizing (`host_pool_tokens`:
    the ratio times the device pool, plus its padding token) and (s)'s host tier as measured
    (the calibration's capacity for (s), what the live run reads from (s)'s metrics)."""
    if plan.get("l3"):
        raise ValueError("with L3 the upper bound's pool holds every history; the simulator "
                         "has no storage tier: validate a run without --l3")
    sglang_host = int(plan["busy_pool"] * plan["host_ratio"]) + 1
    measured = cal["host_copy"]["capacity_tokens"]["s"]
    return plan["busy_pool"] + _lent(cal, plan)[1] + max(sglang_host, measured)


def run_pools(cal: dict, plan: dict, run: str) -> tuple[int, int, int]:
    """(busy device pool, busy host tier, donor pool) in tokens, as bench_tiers sizes run `run`."""
    if run not in RUNS:
        raise ValueError(f"unknown run {run!r}; the simulated runs are {RUNS}")
    lent_donor = _lent(cal, plan)[0]
    if run == "u":  # one stock pool, no host tier
        return upper_bound_pool(cal, plan), 0, plan["donor_pool"] - lent_donor
    host = 0 if run == "r" else cal["host_copy"]["capacity_tokens"][run]
    return plan["busy_pool"], host, plan["donor_pool"]


def served_tokens(prompt: int, max_tokens: int, pool: int,
                  context_len: int = NO_CONTEXT_LIMIT) -> int | None:
    """SGLang 0.5.23's length rules on a server whose KV pool holds `pool` tokens (page size 1):
    None when it refuses the prompt, else the tokens it generates. The worker's
    `max_req_len = min(context_len - 1, pool - 1)` and `max_req_input_len = max_req_len - 5`
    (tp_worker.get_worker_info); a prompt of at least `max_req_input_len` tokens is refused
    (managers/utils.validate_input_length, no --allow-auto-truncate); `max_new_tokens` is cut
    to `max_req_len - prompt - 1` and to the empty pool's budget `pool - prompt - 2`
    (scheduler, allocator `max_new_tokens_for_memory`)."""
    max_req_len = min(context_len - 1, pool - 1)
    if prompt >= max_req_len - 5:
        return None
    return max(0, min(max_tokens, max_req_len - prompt - 1, pool - prompt - 2))


def _traced_request(rid: int, item: dict, now: float, out_tokens: int) -> SimRequest:
    """`cpu_node._request` with the answer cut to `out_tokens` (the server's length rule)."""
    prompt, out = item["prompt_ids"], item["output_ids"][:out_tokens]
    return SimRequest(rid, item["session"], item["turn"], now, len(prompt), len(out),
                      key_prompt=array("q", prompt[:-1]),
                      key_full=array("q", list(prompt) + list(out[:-1])))


def _refused(rid: int, item: dict, now: float) -> SimRequest:
    """A request the server refused: no first token, nothing cached, nothing generated."""
    r = SimRequest(rid, item["session"], item["turn"], now, len(item["prompt_ids"]), 0,
                   key_prompt=array("q"), key_full=array("q"))
    r.rejected = True
    return r


def _server(node: Node, g: int, name: str, compute, pool: int, host: int, donor_tier: bool,
            write_through: bool) -> ModelServer:
    cache = RevokeRecordingCache(pool, host, donor=donor_tier,
                                 write_through=write_through and host > 0, donor_to_host=True)
    lower = donor_tier or host > 0
    srv = ModelServer(name, node.gpus[g], compute, cache, page_tokens=1, chunk=CHUNKED_PREFILL,
                      max_running=MAX_RUNNING, load_mode="layerwise" if lower else "none",
                      node=node, checkpoint_prompt=True, alloc_per_step=True)
    node.gpus[g].server = srv
    node.by_name[name] = srv
    return srv


def simulate_run(cal: dict, plan: dict, run: str) -> dict:
    """One run: records of the busy requests, the reclaim's outcome, the copies by route."""
    pool, host, donor_pool = run_pools(cal, plan, run)
    write_through = plan.get("write_policy", "write_back") == "write_through"
    node = tiers_node(cal)
    busy = _server(node, 0, "busy", compute_for(cal, "busy"), pool, host, run == "s",
                   write_through)
    donor = _server(node, 1, "donor", _idle_compute(cal["models"]["donor"]), donor_pool, 0,
                    False, False)
    lent = node.lend(donor, busy, plan["lend_fraction"], 1.0) if run == "s" else 0
    items = steady_order(cal["trace"]["busy"], plan["turns"])
    per_turn = len(items) // plan["turns"]
    burst_at = plan["burst_after_turn"] * per_turn  # the first request after the burst
    context_len = cal["models"]["busy"].get("context_len", NO_CONTEXT_LIMIT)
    done, refused = [], []

    def send(k: int) -> None:
        if k >= len(items):
            return
        if k == burst_at and run == "s":  # every lent page back before the turns go on
            node._reclaim(node.donations["donor"], busy, RECLAIM_ALL)
            if plan.get("relent_after_burst"):  # the live donor lent again in the pause
                node.relend(donor, busy)
        item = items[k]
        out = served_tokens(len(item["prompt_ids"]),
                            min(plan["max_tokens"], len(item["output_ids"])), pool, context_len)
        if out is None:  # refused at once (an error response): the next request follows
            r = _refused(k, item, node.loop.now)
            done.append(r)
            refused.append(r)
            node.loop.after(0.0, lambda: send(k + 1))
            return
        r = _traced_request(k, item, node.loop.now, out)
        r.on_done = lambda r, k=k: (done.append(r), send(k + 1))
        busy.submit(r)

    node.loop.at(0.0, lambda: send(0))
    node.loop.run()
    busy.cache.check_integrity()
    if busy.rejected:
        raise RuntimeError(f"{len(busy.rejected)} busy requests longer than the pool were "
                           f"rejected by the simulated server after SGLang's length rules "
                           f"admitted them")
    reqs = sorted(done, key=lambda r: r.rid)
    hits = {"device": 0, "donor": 0, "host": 0}
    for r in reqs:
        for tier, n in r.hit_tokens.items():
            hits[tier] = hits.get(tier, 0) + n
    revokes = busy.cache.revokes
    return {"records": [_record(r, "busy") for r in reqs], "hits_by_tier": hits,
            "lent_blocks": lent, "pools": {"busy": pool, "host": host, "donor": donor_pool},
            "rescued_tokens": sum(len(t.dst.indices) for res in revokes for t in res.moved),
            "lost_at_reclaim_tokens": sum(res.num_tokens_lost for res in revokes),
            "reclaims": len(revokes), "load_failures": busy.load_failures,
            "refused": [(r.session, r.turn) for r in refused],
            "donor_tier_tokens_end": busy.cache.tier_pages(DONOR),
            "copied_tokens": {f"{a}->{b}": round(v / busy.page_bytes)
                              for (a, b), v in node.bytes_by_route.items()}}


def run_table(records, turns: int) -> dict:
    """bench_tiers' figures of one run's busy requests (cli.summarize's definitions)."""
    ttft = [r.ttft * 1e3 for r in records if r.ttft is not None]
    by_turn = [0] * turns
    for r in records:
        by_turn[r.turn - 1] += r.cached_tokens or 0
    return {"cached_tokens": sum(r.cached_tokens or 0 for r in records),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "cached_by_turn": by_turn}


def simulate_tiers(cal: dict, plan: dict) -> dict:
    runs = {run: simulate_run(cal, plan, run) for run in RUNS}
    for res in runs.values():
        res["table"] = run_table(res["records"], plan["turns"])
    return runs
