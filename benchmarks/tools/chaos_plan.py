"""The chaos run's pure logic: the fault schedule, and what the measured counters must show.

No server, no I/O: `chaos.py` executes a plan built here against live servers, samples the
borrower's `swiftcache_*` counters around every step, and hands the samples back here to be
judged. Names used throughout: the busy borrower is "borrower", the donors "donor0", "donor1", ...

A plan is a list of `Step`s run one after the other:
- `traffic`: the borrower answers the next `requests` requests of the multi-turn replay;
- `freeze`: SIGSTOP the target's process group for `seconds`, longer than the heartbeat timeout
  (it becomes suspect) and well short of `dead_after_s` (it must not be declared dead), while the
  borrower answers `requests` requests; then SIGCONT;
- `idle`: the borrower gets no request for `seconds` (past the heartbeat timeout);
- `burst`: the target donor's own traffic needs its memory: it reclaims what it lent;
- `kill`: SIGKILL the target donor's process group; `restart`: start it again (new epoch).

Liveness arithmetic (docs/liveness.md): a silent peer is suspect after the heartbeat timeout and
declared dead, while its process lives, only after dead_after_s = max(20 s, 10 x timeout).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FAULT_KINDS = ("freeze", "idle", "burst", "kill", "restart")
STEP_KINDS = ("traffic", *FAULT_KINDS)
BORROWER = "borrower"
COUNTERS = ("revoked_tokens", "lost_leases", "reclaims", "refused_loads", "refused_stores",
            "loads_failed", "loads_requeued", "leases", "loaded_tokens",
            "stored_tokens")  # swiftcache_<name>_total
TIER_GAUGE = "donor_tier_tokens"  # swiftcache_donor_tier_tokens: the borrower's data at stake
DATA_FAULTS = ("freeze", "idle", "burst", "kill")  # faults that test what happens to that data
FREEZE_MARGIN_S = 5.0  # a freeze ends at least this long before a peer could be declared dead


def dead_after_s(heartbeat_timeout_s: float) -> float:
    """When a silent peer whose process still lives is declared dead (docs/liveness.md)."""
    return max(20.0, 10.0 * heartbeat_timeout_s)


@dataclass(frozen=True)
class Step:
    """One step of a plan; `target` is a server name, empty for traffic and idle."""

    kind: str
    target: str = ""
    seconds: float = 0.0
    requests: int = 0

    @property
    def is_fault(self) -> bool:
        return self.kind in FAULT_KINDS

    def label(self) -> str:
        extra = f" {self.seconds:g}s" if self.seconds else ""
        return f"{self.kind}{' ' + self.target if self.target else ''}{extra}" \
               f"{f' +{self.requests} req' if self.requests else ''}"


def fault_cycle(donors: list[str], rng: random.Random, *, freeze_s: float, idle_s: float,
                per_slot: int) -> list[Step]:
    """One round of every fault, targets drawn from `donors` (the killed donor is restarted
    before the cycle ends, so each cycle starts and ends with every server alive)."""
    frozen, burst, killed = (rng.choice(donors) for _ in range(3))
    return [
        Step("freeze", frozen, freeze_s, per_slot),
        Step("traffic", requests=per_slot),
        Step("idle", seconds=idle_s),
        Step("traffic", requests=per_slot),
        Step("freeze", BORROWER, freeze_s, 1),
        Step("burst", burst),
        Step("traffic", requests=per_slot),
        Step("kill", killed),
        Step("traffic", requests=per_slot),
        Step("restart", killed),
        Step("traffic", requests=per_slot),
    ]


def build_plan(donors: list[str], *, cycles: int, per_slot: int, heartbeat_timeout_s: float,
               warmup: int = 0, seed: int = 0, freeze_s: float | None = None,
               idle_s: float | None = None) -> list[Step]:
    """`warmup` requests of traffic (default `per_slot`; give enough that histories are demoted
    into donor memory and loaded back before the first fault), then `cycles` fault cycles.
    First cycle: freeze 3 x the heartbeat timeout (at least 3 s), idle the same (or the given
    lengths); later cycles draw freezes up to `dead_after_s - FREEZE_MARGIN_S` and idles up to
    1.5 x dead_after_s from `seed`."""
    if not donors:
        raise ValueError("a chaos plan needs at least one donor")
    if cycles < 1 or per_slot < 1 or warmup < 0:
        raise ValueError(f"cycles and per_slot must be positive, warmup not negative; got "
                         f"{cycles}, {per_slot}, {warmup}")
    rng = random.Random(seed)
    base_freeze = freeze_s if freeze_s is not None else max(3.0, 3.0 * heartbeat_timeout_s)
    base_idle = idle_s if idle_s is not None else base_freeze
    longest_freeze = dead_after_s(heartbeat_timeout_s) - FREEZE_MARGIN_S
    plan = [Step("traffic", requests=warmup or per_slot)]
    for cycle in range(cycles):
        freeze, idle = base_freeze, base_idle
        if cycle:  # a soak's later cycles draw their lengths: freezes up to just short of
            # death, idles past dead_after_s (an idle borrower must keep its leases forever)
            freeze = round(rng.uniform(base_freeze, max(base_freeze, longest_freeze)), 1)
            idle = round(rng.uniform(base_idle, 1.5 * dead_after_s(heartbeat_timeout_s)), 1)
        plan += fault_cycle(donors, rng, freeze_s=freeze, idle_s=idle, per_slot=per_slot)
    validate(plan, donors, heartbeat_timeout_s)
    return plan


def validate(plan: list[Step], donors: list[str], heartbeat_timeout_s: float) -> None:
    """Raise ValueError naming the first step that would not test what it claims: a freeze
    outside (timeout, dead_after - margin), an idle within the timeout, a fault on a dead server
    or on one that does not exist, the borrower killed, or a donor left dead at the end."""
    dead_after = dead_after_s(heartbeat_timeout_s)
    alive = set(donors)
    for i, step in enumerate(plan):
        where = f"step {i} ({step.label()})"
        if step.kind not in STEP_KINDS:
            raise ValueError(f"{where}: unknown kind; choose one of {', '.join(STEP_KINDS)}")
        if step.kind in ("freeze", "burst", "kill", "restart") and \
                step.target not in (*donors, BORROWER):
            raise ValueError(f"{where}: unknown target; servers are {donors + [BORROWER]}")
        if step.kind in ("burst", "kill", "restart") and step.target == BORROWER:
            raise ValueError(f"{where}: only donors are burst, killed and restarted; the "
                             "borrower's answers are what the run checks")
        if step.kind == "freeze" and not heartbeat_timeout_s < step.seconds <= \
                dead_after - FREEZE_MARGIN_S:
            longest = dead_after - FREEZE_MARGIN_S
            raise ValueError(f"{where}: a freeze must last longer than the heartbeat timeout "
                             f"({heartbeat_timeout_s:g}s) and at most {longest:g}s "
                             f"(dead_after_s {dead_after:g}s minus {FREEZE_MARGIN_S:g}s)")
        if step.kind == "idle" and step.seconds <= heartbeat_timeout_s:
            raise ValueError(f"{where}: an idle phase must outlast the heartbeat timeout "
                             f"({heartbeat_timeout_s:g}s)")
        if step.kind in ("freeze", "burst", "kill") and step.target != BORROWER \
                and step.target not in alive:
            raise ValueError(f"{where}: {step.target} is not running (killed earlier)")
        if step.kind == "kill":
            alive.discard(step.target)
        if step.kind == "restart":
            if step.target in alive:
                raise ValueError(f"{where}: {step.target} is running; kill it first")
            alive.add(step.target)
    if alive != set(donors):
        raise ValueError(f"donors {sorted(set(donors) - alive)} are still dead at the end; "
                         "restart every killed donor")


def total_requests(plan: list[Step]) -> int:
    return sum(s.requests for s in plan)


@dataclass
class StepRecord:
    """What one executed step did and what the borrower's counters did meanwhile.

    `before` / `after`: the borrower's counters (COUNTERS) around the step, after they settled;
    `leases_from_target`: the borrower's leases from the target donor just before the step;
    `target_reclaims`: the target donor's completed reclaims (its reclaim latency histogram's
    count) during the step; `load_503s`: answers to this step's requests that were SwiftCache's
    503 for a failed donor load (each retried); `aborted`: the step could not be carried out
    (why)."""

    step: Step
    before: dict[str, float]
    after: dict[str, float]
    leases_from_target: int = 0
    target_reclaims: float = 0.0
    load_503s: int = 0
    aborted: str = ""

    def delta(self, name: str) -> float:
        return self.after.get(name, 0.0) - self.before.get(name, 0.0)


def lost_while_alive(records: list[StepRecord]) -> tuple[float, float]:
    """(tokens, leases) the borrower lost while every process was alive. Only a kill may cost a
    lease; in any other step a lost lease is a loss while alive, and the tokens revoked in that
    step count as lost (conservative: a burst's reclaim in the same step is counted too)."""
    tokens = leases = 0.0
    for rec in records:
        if rec.step.kind == "kill":
            continue
        lost = rec.delta("lost_leases")
        if lost > 0:
            leases += lost
            tokens += rec.delta("revoked_tokens")
    return tokens, leases


COPY_FAULT_KINDS = ("burst", "kill")  # steps in which a copy may be refused or aborted


def load_may_fail(step: Step) -> bool:
    """Whether a donor load may fail in `step` (its request requeued or answered 503): a
    reclaim fences the
    pages (burst), a dead donor's lease is not readable (kill), and a borrower stopped in a
    forward finds the batch's load deadline (wall clock) passed when it resumes (freeze of
    the borrower). Anywhere else a failed load is a load that missed its deadline unprovoked."""
    return step.kind in COPY_FAULT_KINDS or (step.kind == "freeze" and step.target == BORROWER)


def consistency(records: list[StepRecord], leases_seen: int) -> dict[str, str]:
    """Each check of the counters against what the run did; value "" when it holds, else why.

    - leases: the borrower counted at least every distinct lease `ctl status` showed it holding;
    - reclaims: each burst of a donor that lent to the borrower completed a reclaim on the donor
      and was acknowledged by the borrower; nothing else caused a reclaim;
    - lost leases: each kill of a donor the borrower borrowed from cost it a lease; nothing else
      did;
    - refused copies: loads and stores are refused only in a burst or kill step;
    - failed loads: every failed load on the borrower (`swiftcache_loads_failed_total`) is
      either a request sent back to the waiting queue (`swiftcache_loads_requeued_total`) or a
      503 its client got, step by step, and every such 503 is one; they happen only where
      `load_may_fail`;
    - donor tier used: the borrower loaded tokens back from donor memory at all."""
    checks: dict[str, str] = {}
    final = records[-1].after if records else {}
    checks["leases"] = "" if final.get("leases", 0) >= leases_seen else \
        f"swiftcache_leases_total {final.get('leases', 0):g} < {leases_seen} leases seen in ctl"
    bad = []
    for i, rec in enumerate(records):
        reclaims = rec.delta("reclaims")
        if rec.step.kind == "burst" and rec.leases_from_target:
            if rec.target_reclaims < 1 or reclaims < 1:
                bad.append(f"step {i} {rec.step.label()}: donor completed {rec.target_reclaims:g} "
                           f"reclaims, borrower acknowledged {reclaims:g}")
        elif rec.step.kind not in ("burst", "kill") and reclaims > 0:
            bad.append(f"step {i} {rec.step.label()}: {reclaims:g} reclaims without a burst")
    checks["reclaims"] = "; ".join(bad)
    bad = []
    for i, rec in enumerate(records):
        lost = rec.delta("lost_leases")
        if rec.step.kind == "kill" and rec.leases_from_target and lost < 1:
            bad.append(f"step {i} {rec.step.label()}: held {rec.leases_from_target} leases "
                       "from it, none counted lost")
        elif rec.step.kind != "kill" and lost > 0:
            bad.append(f"step {i} {rec.step.label()}: {lost:g} leases lost while alive")
    checks["lost_leases"] = "; ".join(bad)
    bad = [f"step {i} {rec.step.label()}: {rec.delta('refused_loads'):g} loads, "
           f"{rec.delta('refused_stores'):g} stores refused"
           for i, rec in enumerate(records) if rec.step.kind not in COPY_FAULT_KINDS
           and (rec.delta("refused_loads") > 0 or rec.delta("refused_stores") > 0)]
    checks["refused_copies"] = "; ".join(bad)
    bad = []
    for i, rec in enumerate(records):
        failed, requeued = rec.delta("loads_failed"), rec.delta("loads_requeued")
        if failed != requeued + rec.load_503s:
            bad.append(f"step {i} {rec.step.label()}: {failed:g} loads failed on the borrower, "
                       f"{requeued:g} requests requeued and {rec.load_503s} answered 503")
        elif failed > 0 and not load_may_fail(rec.step):
            bad.append(f"step {i} {rec.step.label()}: {failed:g} loads failed (past the "
                       "batch's deadline?) with no fault to explain it")
    checks["failed_loads"] = "; ".join(bad)
    checks["donor_tier_used"] = "" if final.get("loaded_tokens", 0) > 0 else \
        "no token was loaded back from donor memory: the run did not exercise the donor tier"
    return checks


def faults_on_empty_tier(records: list[StepRecord]) -> list[str]:
    """Faults that met a borrower with nothing in donor memory: they ran, but put no cached
    token at risk (a plan whose warm-up is too short for its pool shows up here)."""
    return [f"step {i} {rec.step.label()}" for i, rec in enumerate(records)
            if rec.step.kind in DATA_FAULTS and not rec.before.get(TIER_GAUGE, 0)]


def fault_counts(records: list[StepRecord]) -> dict[str, int]:
    counts = {kind: 0 for kind in FAULT_KINDS}
    for rec in records:
        if rec.step.is_fault and not rec.aborted:
            counts[rec.step.kind] += 1
    return counts
