"""Chaos run against live SwiftCache servers, every answer checked against stock SGLang.

    python scripts/chaos.py --quick          # one fault cycle, two donors (about 5 min on 2 cores)
    python scripts/chaos.py --cycles 10      # a longer soak: ten cycles, targets drawn by --seed

A busy borrower (the `small` model, a KV pool too small for its conversations) serves multi-turn
ShareGPT conversations while donors (the `tiny` model) lend it pages of their own pools. A fault
schedule (`chaos_plan.py`) freezes a donor and the borrower past the heartbeat timeout, lets the
borrower idle, forces reclaims with donor bursts, SIGKILLs a donor and restarts it. Stock SGLang on
the borrower's model and pool answers the same requests first; the borrower is then sent exactly
those requests (each history carries the stock answers), so every answer is compared on its own.
The last line printed is a JSON object: requests, wrong_tokens (answers that differ from stock),
hangs (no answer within --request-timeout-s), errors (HTTP errors; a 503 for a failed donor
load is retried and counted in load_503s instead), faults, lost_idle_tokens
(donor-tier tokens the borrower lost while every process was alive), the counter checks and the
load average. Exit status 0 only when all of those are clean. Method and figures: docs/chaos.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import chaos_plan as plan_mod
from .chaos_node import ChaosNode, read_metrics, wait_until
from .chaos_plan import BORROWER, COUNTERS, TIER_GAUGE, Step, StepRecord
from .chaos_replay import Replay, ask, pick_conversations
from .tiny_model import ensure_tiny_model, model_dir

SETTLE_S = 2.2  # counters reach /metrics once a second from the scheduler loop (cache.py)
MAX_HANGS = 2  # after this many, the borrower is stuck: stop sending
LOAD_RETRIES = 2  # a 503 for a failed donor load is retried (its message says so) this often


@dataclass
class ChaosOptions:
    """What a chaos run starts and sends; the defaults are `--quick`'s."""

    donors: int = 2
    cycles: int = 1
    per_slot: int = 3  # requests per traffic slot of the plan
    # groups of 8 conversations of 4 turns in a 384-token pool: a group's first round already
    # evicts (8 first turns hold ~400 tokens), and every 4-turn history fits the pool
    conversations: int = 8
    turns: int = 4
    max_tokens: int = 8
    max_chars: int = 150
    pool_tokens: int = 384  # the borrower's and stock's KV pool
    donor_pool_tokens: int = 4096
    max_borrow_blocks: int = 1500
    heartbeat_timeout_s: float = 1.0
    heartbeat_interval_s: float = 0.2
    request_timeout_s: float = 120.0
    seed: int = 0
    out: Path = Path("runs/chaos")


class ChaosRun:
    """Executes a plan on a started node: sends the borrower its requests, injects the faults,
    samples the borrower's counters after every step (`StepRecord`), and sums it all up."""

    def __init__(self, node: ChaosNode, replay: Replay, opts: ChaosOptions) -> None:
        self.node, self.replay, self.opts = node, replay, opts
        self.next = 0
        self.answers: dict[tuple[int, int], str] = {}
        self.hangs: list[str] = []
        self.errors: list[str] = []
        self.load_503s: list[str] = []  # 503s for a failed donor load (retried)
        self.record: StepRecord | None = None  # the step running now
        self.latencies: list[tuple[float, str]] = []  # (seconds, which request, sent when)
        self.step_label = "warm-up"
        self.records: list[StepRecord] = []
        self.leases_seen: set[tuple] = set()

    # ---- traffic --------------------------------------------------------------------------
    def send(self, n: int) -> None:
        for _ in range(n):
            if self.next >= len(self.replay.keys) or len(self.hangs) >= MAX_HANGS:
                return
            key = self.replay.keys[self.next]
            self.next += 1
            t0, sent = time.monotonic(), time.strftime("%H:%M:%S")
            for attempt in range(1 + LOAD_RETRIES):
                kind, value = ask(self.node.servers[BORROWER], self.replay.payload(key),
                                  self.opts.request_timeout_s)
                if kind != "load_failed":
                    break
                self.load_503s.append(f"{key} in step '{self.step_label}', try {attempt + 1}: "
                                      f"{value}")
                if self.record is not None:
                    self.record.load_503s += 1
            self.latencies.append((time.monotonic() - t0,
                                   f"{key} in step '{self.step_label}', sent {sent}"))
            if kind == "ok":
                self.answers[key] = value
            else:
                (self.hangs if kind == "hang" else self.errors).append(f"{key}: {value}")

    # ---- counters -------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        time.sleep(SETTLE_S)  # let the scheduler loop publish what the last step did
        m = read_metrics(self.node.servers[BORROWER])
        self.note_leases()
        return {**{k: m.get(f"swiftcache_{k}_total", 0.0) for k in COUNTERS},
                TIER_GAUGE: m.get(f"swiftcache_{TIER_GAUGE}", 0.0)}

    def note_leases(self) -> None:
        st = self.node.status(BORROWER)
        for ls in st.leases if st else []:
            self.leases_seen.add((ls.donor, ls.epoch, ls.lease_id))

    def lost_leases(self) -> float:
        return read_metrics(self.node.servers[BORROWER]).get("swiftcache_lost_leases_total", 0.0)

    def donor_reclaims(self, name: str) -> float:
        return read_metrics(self.node.servers[name]).get(
            "swiftcache_reclaim_latency_seconds_count", 0.0)

    # ---- the plan -------------------------------------------------------------------------
    def run(self, plan: list[Step]) -> None:
        before = self.counters()
        for i, step in enumerate(plan):
            print(f"[chaos] step {i + 1}/{len(plan)}: {step.label()}", flush=True)
            self.step_label = f"{i} {step.label()}"
            rec = self.record = StepRecord(step, before, before)
            try:
                self.execute(step, rec)
            except Exception as exc:  # a fault that could not be carried out is reported
                rec.aborted = f"{type(exc).__name__}: {exc}"
                print(f"[chaos]   aborted: {rec.aborted}", flush=True)
            rec.after = before = self.counters()
            self.records.append(rec)
            if len(self.hangs) >= MAX_HANGS:
                print("[chaos] the borrower stopped answering: plan abandoned", flush=True)
                break

    def execute(self, step: Step, rec: StepRecord) -> None:
        node, t = self.node, step.target
        if step.kind in ("burst", "kill") and t != BORROWER:
            rec.leases_from_target = len(node.leases_from(t))
        if step.kind == "traffic":
            self.send(step.requests)
        elif step.kind == "freeze":
            node.freeze(t)
            thaw = node.thaw_after(t, step.seconds)
            self.send(step.requests)
            thaw.join()
        elif step.kind == "idle":
            time.sleep(step.seconds)  # the borrower idles: the fault itself
        elif step.kind == "burst":
            reclaims = self.donor_reclaims(t)
            st = node.status(t)
            lent = st.capacity.lent_tokens if st is not None and st.capacity else 0
            node.burst(t)
            if lent:  # it lent pages: the burst must bring every one of them back
                wait_until(lambda: self.donor_reclaims(t) > reclaims, 60)
            rec.target_reclaims = self.donor_reclaims(t) - reclaims
            # after its cooldown it lends again: the next faults meet a donor tier in use
            wait_until(lambda: node.leases_from(t), 30)
        elif step.kind == "kill":
            lost = self.lost_leases()
            node.kill(t)  # its agent id stays the current one until the restart
            wait_until(lambda: node.status(BORROWER) is not None and not node.leases_from(t), 60)
            if rec.leases_from_target:  # and the runtime has counted the loss
                wait_until(lambda: self.lost_leases() > lost, 30)
        elif step.kind == "restart":
            node.restart(t)
            wait_until(lambda: node.leases_from(t), 60)  # it may have nothing to lend to us

    # ---- the result -----------------------------------------------------------------------
    def summary(self, started: float, load_start: tuple) -> dict:
        wrong = [f"{k}: stock {self.replay.reference[k]!r}, borrower {v!r}"
                 for k, v in self.answers.items() if v != self.replay.reference[k]]
        lost_tokens, lost_leases = plan_mod.lost_while_alive(self.records)
        checks = plan_mod.consistency(self.records, len(self.leases_seen))
        final = self.records[-1].after if self.records else {}
        return {
            "requests": self.next, "answered": len(self.answers), "wrong_tokens": len(wrong),
            "hangs": len(self.hangs), "errors": len(self.errors),
            "load_503s": len(self.load_503s),
            "faults": sum(plan_mod.fault_counts(self.records).values()),
            "faults_by_kind": plan_mod.fault_counts(self.records),
            "aborted_steps": [f"{r.step.label()}: {r.aborted}" for r in self.records if r.aborted],
            "faults_on_empty_tier": plan_mod.faults_on_empty_tier(self.records),
            "lost_idle_tokens": lost_tokens, "lost_leases_while_alive": lost_leases,
            "borrower_counters": final, "leases_seen": len(self.leases_seen),
            "inconsistent": {k: v for k, v in checks.items() if v},
            "max_answer_s": round(max(self.latencies, default=(0.0, ""))[0], 2),
            "seconds": round(time.monotonic() - started, 1),
            "load_avg": [list(load_start), [round(x, 2) for x in os.getloadavg()]],
            "details": {"wrong": wrong, "hangs": self.hangs, "errors": self.errors,
                        "load_503s": self.load_503s,
                        "slowest_answers": [f"{s:.1f}s: {what}" for s, what in
                                            sorted(self.latencies, reverse=True)[:3]]},
        }


def clean(result: dict) -> bool:
    return not (result["wrong_tokens"] or result["hangs"] or result["errors"]
                or result["lost_idle_tokens"] or result["lost_leases_while_alive"]
                or result["inconsistent"] or result["aborted_steps"]
                or result["answered"] < result["requests"])


def run_chaos(opts: ChaosOptions) -> dict:
    """Start the servers, answer every request on stock, run the plan on the borrower, judge."""
    started, load_start = time.monotonic(), tuple(round(x, 2) for x in os.getloadavg())
    donors = [f"donor{i}" for i in range(opts.donors)]
    # warm-up: a round of every conversation and a slot more, so histories were demoted into
    # donor memory and some loaded back before the first fault
    plan = plan_mod.build_plan(donors, cycles=opts.cycles, per_slot=opts.per_slot,
                               warmup=opts.conversations + opts.per_slot,
                               heartbeat_timeout_s=opts.heartbeat_timeout_s, seed=opts.seed)
    small = ensure_tiny_model(model_dir("small"), shape="small")
    groups = Replay.groups_for(plan_mod.total_requests(plan), opts.conversations, opts.turns)
    convs = pick_conversations(groups * opts.conversations, opts.turns, opts.max_chars,
                               opts.pool_tokens, small, opts.max_tokens)
    replay = Replay(convs, group=opts.conversations, turns=opts.turns,
                    max_tokens=opts.max_tokens)
    del replay.keys[plan_mod.total_requests(plan):]  # the last group may be cut short
    opts.out.mkdir(parents=True, exist_ok=True)
    node = ChaosNode(small, ensure_tiny_model(model_dir("tiny"), shape="tiny"), donors=opts.donors,
                     out=opts.out, pool_tokens=opts.pool_tokens,
                     donor_pool_tokens=opts.donor_pool_tokens,
                     max_borrow_blocks=opts.max_borrow_blocks,
                     heartbeat_timeout_s=opts.heartbeat_timeout_s,
                     heartbeat_interval_s=opts.heartbeat_interval_s)
    run = ChaosRun(node, replay, opts)
    try:
        print(f"[chaos] starting stock, borrower and {opts.donors} donor(s); plan: "
              f"{len(plan)} steps, {plan_mod.total_requests(plan)} requests", flush=True)
        with node.starting() as started_all:
            started_all["stock"].result()
            stock_s = 0.0  # its slowest answer: what this machine's load alone costs
            for key in replay.keys:  # stock first: its answers are the reference and histories
                for future in started_all.values():  # a server that failed to start: stop now
                    if future.done() and future.exception() is not None:
                        raise future.exception()
                t0 = time.monotonic()
                kind, value = ask(node.servers["stock"], replay.payload(key),
                                  opts.request_timeout_s)
                stock_s = max(stock_s, time.monotonic() - t0)
                if kind != "ok":
                    raise RuntimeError(f"stock SGLang failed request {key}: {value}")
                replay.reference[key] = value
            node.stop("stock")
        setup_s = time.monotonic() - started
        if not wait_until(lambda: any(node.leases_from(d) for d in donors), 120):
            raise RuntimeError(f"the borrower got no lease within 120 s; see {opts.out}")
        plan_started = time.monotonic()
        run.run(plan)
        result = run.summary(started, load_start)
        result["stock_max_answer_s"] = round(stock_s, 2)
        result["phases_s"] = {"start_and_stock": round(setup_s, 1),
                              "plan": round(time.monotonic() - plan_started, 1)}
        lost_lines = [line for line in node.servers[BORROWER].log_text().splitlines()
                      if " lost (" in line or "declared dead" in line]
        result["details"]["borrower_lost_lines"] = lost_lines[-20:]
    finally:
        node.close()
    result["plan"] = [s.label() for s in plan]
    result["records"] = [{**asdict(r), "step": r.step.label()} for r in run.records]
    (opts.out / "chaos.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one fault cycle (the default plan)")
    ap.add_argument("--cycles", type=int, default=None, help="fault cycles (soak: 10 or more)")
    d = ChaosOptions()
    ap.add_argument("--donors", type=int, default=d.donors)
    ap.add_argument("--per-slot", type=int, default=d.per_slot, help="requests per traffic slot")
    ap.add_argument("--conversations", type=int, default=d.conversations,
                    help="conversations replayed round-robin (their turns grow with the plan: "
                         "keep the longest history within the borrower's pool)")
    ap.add_argument("--heartbeat-timeout-s", type=float, default=d.heartbeat_timeout_s)
    ap.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                    help="an answer later than this is a hang")
    ap.add_argument("--seed", type=int, default=0, help="draws the soak's fault targets")
    ap.add_argument("--out", type=Path, default=Path("runs/chaos"))
    args = ap.parse_args(argv)
    cycles = 1 if args.quick or args.cycles is None else args.cycles
    if args.quick and args.cycles not in (None, 1):
        ap.error("--quick runs one cycle; drop --cycles or --quick")
    for name in ("donors", "per_slot", "conversations"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    opts = ChaosOptions(donors=args.donors, cycles=cycles, per_slot=args.per_slot,
                        conversations=args.conversations,
                        heartbeat_timeout_s=args.heartbeat_timeout_s,
                        request_timeout_s=args.request_timeout_s, seed=args.seed, out=args.out)
    result = run_chaos(opts)
    line = {k: v for k, v in result.items() if k not in ("details", "records", "plan")}
    print(f"details: {opts.out / 'chaos.json'}")
    print(json.dumps(line))
    return 0 if clean(result) else 1
