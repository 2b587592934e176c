"""P99 TTFT against request rate on the node benchmark's two models (scripts/bench_rate.py).

The pure part: what a sweep sends and how one rate point is judged. No servers, no I/O
except reading ShareGPT.

Workload. Real ShareGPT conversations (messages clipped as `NodePlan.max_chars`, the node
benchmark's setting) become sessions of `turns` turns. Sessions arrive open-loop, a Poisson
process of `rate` sessions per second over an arrival window; within a session each turn is sent
after the previous answer arrived plus a think time drawn Exp(`think_mean_s`), carrying the whole
history with the model's own answers. Session i is the same conversation, with the same think
times, at every rate, and its start time scales as 1 / rate (unit-rate gaps drawn once), so a
higher rate replays a superset of a lower rate's sessions, packed closer together.

Judging a point (`judge_point`). TTFT is the client's: send to the first streamed token. A
request still without a first token when the point ends (the drain timeout) counts with the time
it has waited so far, so an overloaded point's P99 is not hidden by the requests it never
answered (as the simulator does, `simulator.run_metrics.metrics`). The queue is what the client
sees waiting: requests sent and not yet answered with a first token (queued or in prefill),
sampled once a second over the arrival window. A point is **stable** when that queue does not
grow over the window: its mean over the last quarter of the window is at most 1.5 times its mean
over the second quarter plus 1 request (`queue_not_growing`). A queue growing linearly from 0 by
g requests over the window fails this once g > 3.2; a flat queue passes whatever its level. The
simulator's rule (`simulator.run_metrics.stable`: twice plus 2) suits a GPU node's queues of
tens or hundreds of requests; at the handful a CPU point queues, its +2 would pass a queue that
tripled (2 -> 6), so the live rule is tighter. `drained` says, beside it, whether every session
also finished within the drain timeout after the window; a rate is sustained when both hold.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..loadgen.client import RequestRecord
from ..loadgen.stats import pct
from ..workloads.sharegpt import Conversation, load_conversations
from .plan import NodePlan

QUEUE_SAMPLE_S = 1.0  # the queue is sampled once a second over the arrival window
GROWTH_FACTOR, GROWTH_SLACK = 1.5, 1.0  # growing: last quarter > 1.5 x second quarter + 1


@dataclass(frozen=True)
class RatePlan:
    """One sweep: the rates, the window each rate's sessions arrive in, the sessions' shape."""

    # sessions per second; on this CPU at a load average of 5-7, stock SGLang's queue held at
    # 1/s and grew at 2/s (3-turn sessions): the sweep brackets that knee
    rates: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
    window_s: float = 120.0  # sessions arrive during this window at each rate
    drain_s: float = 90.0  # after the window, unanswered requests get this long, then are cut
    turns: int = 3  # per session
    # Exp(mean) wait after an answer before the next turn (0: none); 2 s lets a few sessions'
    # histories overlap in the busy pool, as users' turns do, without stretching the sweep
    think_mean_s: float = 2.0
    seed: int = 0
    systems: tuple[str, ...] = ("stock", "swiftcache", "ideal")

    def __post_init__(self) -> None:
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be positive sessions/s, got {self.rates}")
        if list(self.rates) != sorted(set(self.rates)):
            raise ValueError(f"rates must be increasing and distinct, got {self.rates}")
        if self.window_s <= 0 or self.drain_s < 0 or self.turns <= 0 or self.think_mean_s < 0:
            raise ValueError("window_s and turns must be positive, drain_s and think_mean_s "
                             "not negative")
        unknown = set(self.systems) - set(SYSTEMS)
        if not self.systems or unknown:
            raise ValueError(f"systems must be among {SYSTEMS}, got {self.systems}")

    @classmethod
    def quick(cls) -> "RatePlan":
        return cls(rates=(0.5, 1.0, 1.5), window_s=25.0, drain_s=25.0, turns=3,
                   systems=("stock", "swiftcache"))

    def max_sessions(self) -> int:
        """Sessions the highest rate can start within the window (an upper bound)."""
        return len(unit_arrivals(self.seed, self.rates[-1] * self.window_s))


# stock: stock SGLang, the node benchmark's pools; swiftcache: the donor lends half its pool to
# the busy server; ideal: stock with the lendable capacity moved into the busy pool for good;
# hicache: stock plus --enable-hierarchical-cache (SGLang's host tier), tried, see docs/results.md
SYSTEMS = ("stock", "swiftcache", "ideal", "hicache")


@dataclass(frozen=True)
class Session:
    """One conversation replayed as a session: user messages and the think time after each
    answer (the last one unused)."""

    id: str
    users: tuple[str, ...]
    think_s: tuple[float, ...]


def unit_arrivals(seed: int, horizon: float) -> list[float]:
    """Arrival times of a rate-1 Poisson process in [0, horizon), the first at 0 (a point should
    not open idle). Start times at rate r are these divided by r (those under the window)."""
    rng = random.Random(seed * 7919 + 1)
    out, t = [], 0.0
    while t < horizon:
        out.append(t)
        t += rng.expovariate(1.0)
    return out


def start_times(plan: RatePlan, rate: float) -> list[float]:
    """Session start offsets (s) at `rate`: the unit arrivals scaled, within the window."""
    return [t / rate for t in unit_arrivals(plan.seed, rate * plan.window_s)]


def build_sessions(plan: RatePlan, node: NodePlan, count: int,
                   conversations: list[Conversation] | None = None) -> list[Session]:
    """`count` sessions of `plan.turns` turns from ShareGPT (file order, deterministic), think
    times from their own seeded stream. `conversations` replaces the file (tests)."""
    convs = conversations if conversations is not None else load_conversations(
        count, min_turns=plan.turns, max_chars_per_message=node.max_chars)
    if len(convs) < count:
        raise RuntimeError(f"found {len(convs)} ShareGPT conversations of {plan.turns} turns, "
                           f"need {count}; lower --rates or --window-s")
    rng = random.Random(plan.seed * 104729 + 7)
    out = []
    for conv in convs[:count]:
        if len(conv.turns) < plan.turns:
            raise ValueError(f"conversation {conv.id} has {len(conv.turns)} turns, "
                             f"fewer than {plan.turns}")
        think = tuple(rng.expovariate(1.0 / plan.think_mean_s) if plan.think_mean_s > 0 else 0.0
                      for _ in range(plan.turns))
        out.append(Session(conv.id, tuple(t.user for t in conv.turns[:plan.turns]), think))
    return out


@dataclass
class PointResult:
    """What one system did at one rate, as `judge_point` judged it (times in ms)."""

    system: str
    rate: float
    sessions: int
    sessions_done: int
    sent: int
    completed: int  # requests answered in full, without error
    unanswered: int  # sent, no first token by the end: counted in TTFT with the time waited
    errors: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    prompt_tokens: int
    cached_tokens: int
    queue_q2: float  # mean client-side queue over the window's second quarter
    queue_q4: float  # ... and over its last quarter
    stable: bool
    drained: bool
    end_s: float  # when the point ended (all done, or the window plus the drain timeout)
    extra: dict = field(default_factory=dict)  # load averages, server counters, wall time

    def to_json(self) -> dict:
        return dict(self.__dict__)


def queue_samples(records: list[RequestRecord], window_s: float,
                  step_s: float = QUEUE_SAMPLE_S) -> list[tuple[float, int]]:
    """(t, requests sent and without a first token at t) every `step_s` over [0, window_s)."""
    spans = []
    for r in records:
        if r.error is not None:
            end = r.t_send + (r.e2e or 0.0)  # an error answers the request
        elif r.ttft is not None:
            end = r.t_send + r.ttft
        else:
            end = float("inf")
        spans.append((r.t_send, end))
    out, k = [], 0
    while k * step_s < window_s:
        t = k * step_s
        out.append((t, sum(1 for a, b in spans if a <= t < b)))
        k += 1
    return out


def _mean_between(queue: list[tuple[float, int]], lo: float, hi: float) -> float:
    xs = [n for t, n in queue if lo <= t < hi]
    return sum(xs) / len(xs) if xs else 0.0


def queue_not_growing(queue: list[tuple[float, int]], window_s: float) -> bool:
    """The queue's mean over the window's last quarter is at most GROWTH_FACTOR times its mean
    over the second quarter plus GROWTH_SLACK requests."""
    q2 = _mean_between(queue, 0.25 * window_s, 0.5 * window_s)
    return _mean_between(queue, 0.75 * window_s, window_s) <= GROWTH_FACTOR * q2 + GROWTH_SLACK


def judge_point(system: str, rate: float, records: list[RequestRecord], sessions: int,
                sessions_done: int, window_s: float, end_s: float) -> PointResult:
    """Percentiles, completion and stability of one rate point (see the module docstring)."""
    ok = [r for r in records if r.error is None and r.ttft is not None]
    waiting = [r for r in records if r.error is None and r.ttft is None]
    ttft_ms = [r.ttft * 1e3 for r in ok] + [max(0.0, end_s - r.t_send) * 1e3 for r in waiting]
    queue = queue_samples(records, window_s)
    p50, p99 = pct(ttft_ms, 50), pct(ttft_ms, 99)
    return PointResult(
        system=system, rate=rate, sessions=sessions, sessions_done=sessions_done,
        sent=len(records), completed=sum(1 for r in ok if r.e2e is not None),
        unanswered=len(waiting), errors=sum(1 for r in records if r.error is not None),
        ttft_p50_ms=None if p50 is None else round(p50, 1),
        ttft_p99_ms=None if p99 is None else round(p99, 1),
        prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        cached_tokens=sum(r.cached_tokens or 0 for r in ok),
        queue_q2=round(_mean_between(queue, 0.25 * window_s, 0.5 * window_s), 2),
        queue_q4=round(_mean_between(queue, 0.75 * window_s, window_s), 2),
        stable=queue_not_growing(queue, window_s),
        drained=sessions_done == sessions and not waiting, end_s=round(end_s, 2))


def highest_stable_rate(points: list[PointResult]) -> float | None:
    """The highest swept rate at which the point and every lower one were stable and drained
    (a sustained rate, as the simulator's goodput search counts it; no SLO on CPU)."""
    best = None
    for p in sorted(points, key=lambda p: p.rate):
        if not (p.stable and p.drained):
            break
        best = p.rate
    return best


def summary_json(points: list[PointResult], failures: dict[str, str]) -> dict:
    """The last JSON line: per system, per rate: p50, p99, completed, stable (and drained);
    the highest sustained rate per system; systems that could not run, with why."""
    out: dict = {"unit": "ms; rate in sessions/s", "systems": {}, "failed": dict(failures)}
    for system in dict.fromkeys(p.system for p in points):
        pts = sorted((p for p in points if p.system == system), key=lambda p: p.rate)
        out["systems"][system] = {
            "points": [{"rate": p.rate, "p50": p.ttft_p50_ms, "p99": p.ttft_p99_ms,
                        "completed": p.completed, "sent": p.sent, "stable": p.stable,
                        "drained": p.drained} for p in pts],
            "highest_stable_rate": highest_stable_rate(pts)}
    return out
