"""This CPU node as the simulator sees it: bench_node's two servers, models and steady-phase
traffic, with the parameters scripts/calibrate_cpu.py measured (SIMULATED figures, for
`simulate.py --validate`).

The three runs of bench_node (nodebench/plan.py):
  stock       busy `small` pool `busy_pool`, donor `tiny` pool `donor_pool`, SGLang radix caches
  swiftcache  the same pools; the donor lends `lend_fraction` of its pool (Node.lend, the ledger)
              in the leases the live borrower asks for (the first sized one donor page per
              wanted block, before it knows the donor's layout: 128 + 384 blocks here), the
              busy server's radix_ext tree gets a donor tier; an eviction that needs room
              stores its victims there before the step computes, as the live borrower does
              (`demote_ahead` > 0 models demoting ahead to keep that share of the pool free
              instead); hits load back layer by layer;
              copies cost the measured PoolTransferEngine time
  ideal       stock, the busy pool grown by what the simulated (b) borrowed, the donor's shrunk by
              what it lent
Traffic (nodebench/traffic.py, steady phase): the busy model's conversations interleaved turn by
turn, one request at a time, each sent when the previous one's stream ended; the donor's light
requests one every `donor_interval_s` or when the previous ended. Keys are the traced token ids:
a request's prompt enters the tree when its prefill ends, and a finished request's prompt and
all but its last output token, as SGLang does (checkpoint, then release), page size 1 (SGLang's
CPU default). The reclaim phase (the donor's burst) is not simulated.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from ..loadgen.client import RequestRecord
from ..nodebench.report import run_tables
from .cache_adapter import TreeCache
from .cpu_calibration import compute_for
from .node import Node
from .server import ModelServer, SimRequest

CHUNKED_PREFILL = 4096  # SGLang's chunked_prefill_size on this CPU (the servers' logged args)
MAX_RUNNING = 512  # SGLang's max_running_requests there
UNLIMITED = 1e15  # B/s: copy time is all latency (the measured engine did not slow with size)


@dataclass(frozen=True)
class RunPlan:
    name: str  # stock | swiftcache | ideal
    busy_pool: int
    donor_pool: int
    swiftcache: bool


def _bandwidth(fit: dict) -> float:
    bw = fit["bytes_per_s"]
    return UNLIMITED if bw == float("inf") or bw > UNLIMITED else bw


def _node(cal: dict) -> Node:
    """Two 'GPUs' (the two server processes); the donor tier's loads come in over the busy
    side's ingress, stores go out to the donor's, each at the measured engine's cost."""
    copy = cal["copy"]
    node = Node(UNLIMITED, UNLIMITED, 2,
                copy_latency_s={("donor", "device"): copy["load"]["latency_s"],
                                ("device", "donor"): copy["store"]["latency_s"]})
    node.gpus[0].nvl_in.bandwidth = _bandwidth(copy["load"])
    node.gpus[1].nvl_in.bandwidth = _bandwidth(copy["store"])
    return node


def _server(node: Node, g: int, name: str, compute, pool: int, donor_tier: bool,
            demote_ahead: float = 0.0) -> ModelServer:
    srv = ModelServer(name, node.gpus[g], compute, TreeCache(pool, 0, donor=donor_tier),
                      page_tokens=1, chunk=CHUNKED_PREFILL, max_running=MAX_RUNNING,
                      load_mode="layerwise" if donor_tier else "none", node=node,
                      demote_headroom=int(pool * demote_ahead) if donor_tier else 0,
                      checkpoint_prompt=True, alloc_per_step=True)
    node.gpus[g].server = srv
    node.by_name[name] = srv
    return srv


def _request(rid: int, item: dict, now: float) -> SimRequest:
    """A traced request: its prompt matches the cache up to its last token; it caches its prompt
    and all but its last answer token (that token's KV is never computed)."""
    prompt, out = item["prompt_ids"], item["output_ids"]
    return SimRequest(rid, item["session"], item["turn"], now, len(prompt), len(out),
                      key_prompt=array("q", prompt[:-1]),
                      key_full=array("q", list(prompt) + list(out[:-1])))


def _record(r: SimRequest, label: str) -> RequestRecord:
    rec = RequestRecord(session=r.session, turn=r.turn, server=label, t_send=r.arrival)
    rec.ttft = r.ttft
    rec.e2e = None if r.finish is None else r.finish - r.arrival
    rec.prompt_tokens, rec.completion_tokens = r.prompt_tokens, r.output_tokens
    rec.cached_tokens = 0 if r.rejected else sum(r.hit_tokens.values())
    return rec


def steady_order(trace: list[dict], turns: int) -> list[dict]:
    """bench_node's busy order: turn 1 of every conversation (file order), then turn 2, ..."""
    sessions = list(dict.fromkeys(t["session"] for t in trace))
    by = {(t["session"], t["turn"]): t for t in trace}
    missing = [(s, k) for k in range(1, turns + 1) for s in sessions if (s, k) not in by]
    if missing:
        raise ValueError(f"the calibration trace lacks {len(missing)} busy turns "
                         f"(first {missing[0]}); "
                         f"rerun scripts/calibrate_cpu.py with the plan of the live run")
    return [by[(s, k)] for k in range(1, turns + 1) for s in sessions]


def donor_order(trace: list[dict], requests: int) -> list[dict]:
    """bench_node's light donor order: request k is conversation k % n, turn k // n + 1."""
    sessions = list(dict.fromkeys(t["session"] for t in trace))
    by = {(t["session"], t["turn"]): t for t in trace}
    return [by[(sessions[k % len(sessions)], k // len(sessions) + 1)] for k in range(requests)]


def simulate_run(cal: dict, run: RunPlan, plan: dict, demote_ahead: float = 0.0) -> dict:
    """One run's steady phase; returns records per stream (RequestRecords) and what was lent.
    `demote_ahead`: the fraction of its pool a borrower keeps free by demoting ahead of need."""
    node = _node(cal)
    busy = _server(node, 0, "busy", compute_for(cal, "busy"), run.busy_pool, run.swiftcache,
                   demote_ahead)
    donor = _server(node, 1, "donor", compute_for(cal, "donor"), run.donor_pool, False)
    lent_blocks = (node.lend(donor, busy, plan["lend_fraction"], plan["reclaim_watermark"])
                   if run.swiftcache else 0)
    busy_items = steady_order(cal["trace"]["busy"], plan["turns"])
    donor_items = donor_order(cal["trace"]["donor"], plan["donor_requests"])
    done: dict[str, list[SimRequest]] = {"busy": [], "donor": []}

    def send_busy(k: int) -> None:
        if k >= len(busy_items):
            return
        r = _request(k, busy_items[k], node.loop.now)
        r.on_done = lambda r, k=k: (done["busy"].append(r), send_busy(k + 1))
        busy.submit(r)

    def send_donor(k: int) -> None:
        if k >= len(donor_items):
            return
        r = _request(10_000 + k, donor_items[k], node.loop.now)

        def finished(r, k=k):
            done["donor"].append(r)
            # an open schedule: request k+1 at (k+1) x interval, or now if request k ended later
            node.loop.at(max(node.loop.now, (k + 1) * plan["donor_interval_s"]),
                         lambda: send_donor(k + 1))

        r.on_done = finished
        donor.submit(r)

    node.loop.at(0.0, lambda: send_busy(0))
    node.loop.at(0.0, lambda: send_donor(0))
    node.loop.run()
    for srv in (busy, donor):
        srv.cache.check_integrity()
        if srv.rejected:
            raise RuntimeError(f"{srv.name}: {len(srv.rejected)} requests longer than the pool "
                               f"were rejected")
    records = {s: [_record(r, s) for r in sorted(reqs, key=lambda r: r.rid)]
               for s, reqs in done.items()}
    return {"records": records, "lent_blocks": lent_blocks,
            "lent_donor_tokens": len(donor.lent_pages), "busy_pool": run.busy_pool,
            "donor_pool": run.donor_pool,
            "copied_bytes": {f"{a}->{b}": v for (a, b), v in node.bytes_by_route.items()}}


def simulate_node(cal: dict, plan: dict, demote_ahead: float = 0.0) -> dict:
    """The three runs; (c)'s pools come from what (b) moved, as bench_node derives them."""
    runs = {"a": simulate_run(cal, RunPlan("stock", plan["busy_pool"], plan["donor_pool"], False),
                              plan),
            "b": simulate_run(cal, RunPlan("swiftcache", plan["busy_pool"], plan["donor_pool"],
                                           True), plan, demote_ahead)}
    b = runs["b"]
    runs["c"] = simulate_run(cal, RunPlan("ideal", plan["busy_pool"] + b["lent_blocks"],
                                          plan["donor_pool"] - b["lent_donor_tokens"], False), plan)
    for r in runs.values():
        r["tables"] = run_tables(r["records"])
    return runs
