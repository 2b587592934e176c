"""The chaos run's pure logic (tools/chaos_plan.py, chaos_replay.Replay): plans, traffic order,
and how counters are judged."""

from __future__ import annotations

import pytest

from benchmarks.tools.chaos_plan import (
    BORROWER,
    Step,
    StepRecord,
    build_plan,
    consistency,
    dead_after_s,
    fault_counts,
    faults_on_empty_tier,
    lost_while_alive,
    total_requests,
    validate,
)

DONORS = ["donor0", "donor1"]


def test_quick_plan_injects_every_fault_and_ends_with_every_donor_alive():
    """One cycle holds each fault kind; every freeze is longer than the heartbeat timeout and
    shorter than dead_after_s; the killed donor is restarted; traffic runs during the freezes."""
    plan = build_plan(DONORS, cycles=1, per_slot=3, warmup=11, heartbeat_timeout_s=1.0)
    kinds = [s.kind for s in plan]
    assert plan[0] == Step("traffic", requests=11)  # warm-up: histories in donor memory first
    for kind in ("freeze", "idle", "burst", "kill", "restart"):
        assert kind in kinds
    freezes = [s for s in plan if s.kind == "freeze"]
    assert {s.target for s in freezes} & set(DONORS) and BORROWER in {s.target for s in freezes}
    assert all(1.0 < s.seconds < dead_after_s(1.0) and s.requests >= 1 for s in freezes)
    killed = next(s.target for s in plan if s.kind == "kill")
    assert kinds.index("restart") > kinds.index("kill")
    assert next(s.target for s in plan if s.kind == "restart") == killed
    assert total_requests(plan) == 11 + 3 * 6 + 1  # a donor freeze, five slots; 1 frozen


def test_soak_plan_is_reproducible_from_its_seed_and_draws_targets():
    """The same seed gives the same plan; cycles draw their targets among all donors, and
    later cycles freeze up to just short of dead_after_s and idle past it."""
    a = build_plan(DONORS, cycles=12, per_slot=2, heartbeat_timeout_s=1.0, seed=7)
    assert a == build_plan(DONORS, cycles=12, per_slot=2, heartbeat_timeout_s=1.0, seed=7)
    assert {s.target for s in a if s.kind == "kill"} == set(DONORS)
    assert sum(s.kind == "kill" for s in a) == 12
    # later cycles draw longer pauses: freezes still short of death, idles past dead_after_s
    freezes = [s.seconds for s in a if s.kind == "freeze"]
    idles = [s.seconds for s in a if s.kind == "idle"]
    assert freezes[:2] == [3.0, 3.0] and idles[0] == 3.0
    assert max(freezes) <= dead_after_s(1.0) - 5.0 and len(set(freezes)) > 2
    assert max(idles) > dead_after_s(1.0)


@pytest.mark.parametrize("plan, message", [
    ([Step("freeze", "donor0", 1.0, 1)], "longer than the heartbeat timeout"),
    ([Step("freeze", "donor0", 19.0, 1)], "at most 15s"),
    ([Step("idle", seconds=0.5)], "outlast the heartbeat timeout"),
    ([Step("kill", BORROWER)], "only donors"),
    ([Step("kill", "donor0"), Step("burst", "donor0")], "not running"),
    ([Step("restart", "donor0")], "is running"),
    ([Step("kill", "donor0")], "still dead at the end"),
    ([Step("burst", "donor9")], "unknown target"),
    ([Step("panic")], "unknown kind"),
])
def test_validate_refuses_steps_that_would_not_test_what_they_claim(plan, message):
    """A freeze that is no suspicion or already death, an idle within the timeout, faults on dead
    or unknown servers, and donors left dead are refused with the reason."""
    with pytest.raises(ValueError, match=message):
        validate(plan, DONORS, heartbeat_timeout_s=1.0)


def test_freeze_bounds_follow_dead_after_for_long_timeouts():
    """dead_after_s = max(20 s, 10 x timeout): with a 5 s timeout a 40 s freeze is still a pause."""
    assert dead_after_s(1.0) == 20.0 and dead_after_s(5.0) == 50.0
    validate([Step("freeze", "donor0", 40.0, 1)], DONORS, heartbeat_timeout_s=5.0)


def _rec(kind, target="", before=None, after=None, **kw) -> StepRecord:
    base = {"revoked_tokens": 0, "lost_leases": 0, "reclaims": 0, "refused_loads": 0,
            "refused_stores": 0, "loads_failed": 0, "leases": 1, "loaded_tokens": 100}
    return StepRecord(Step(kind, target), {**base, **(before or {})},
                      {**base, **(before or {}), **(after or {})}, **kw)


def test_lost_while_alive_counts_only_losses_outside_kills():
    """Tokens revoked in a kill step are expected; a lost lease in any other step counts its
    step's revoked tokens as lost while alive; a reclaim alone loses nothing."""
    records = [
        _rec("burst", "donor0", after={"revoked_tokens": 300, "reclaims": 1}),
        _rec("kill", "donor0", {"revoked_tokens": 300}, {"revoked_tokens": 500, "lost_leases": 1}),
        _rec("freeze", "donor1", {"revoked_tokens": 500, "lost_leases": 1},
             {"revoked_tokens": 640, "lost_leases": 2}),
    ]
    assert lost_while_alive(records) == (140, 1)
    assert lost_while_alive(records[:2]) == (0, 0)


def test_consistency_accepts_what_the_faults_explain():
    """A burst on a lending donor: donor reclaim and borrower ack; a kill: a lost lease and
    refused loads; leases counted >= leases seen; the donor tier used: every check holds."""
    records = [
        _rec("traffic"),
        _rec("burst", "donor0", after={"reclaims": 1, "revoked_tokens": 50},
             leases_from_target=1, target_reclaims=1),
        _rec("kill", "donor0", {"reclaims": 1},
             {"lost_leases": 1, "refused_loads": 2, "leases": 2}, leases_from_target=1),
    ]
    assert consistency(records, leases_seen=2) == {
        "leases": "", "reclaims": "", "lost_leases": "", "refused_copies": "",
        "failed_loads": "", "donor_tier_used": ""}


def test_failed_loads_match_the_requeues_and_503s_and_happen_only_where_a_fault_explains_them():
    """Each failed donor load on the borrower is one request requeued or one 503 the client got
    in the same step: a frozen borrower or a kill may explain one; a failed load neither
    requeued nor seen by the client, a 503 the borrower did not count, or a failed load in plain
    traffic or a donor's freeze is named."""
    ok = [_rec("freeze", BORROWER, after={"loads_failed": 1}, load_503s=1),
          _rec("kill", "donor0", {"loads_failed": 1}, {"loads_failed": 2, "lost_leases": 1},
               leases_from_target=1, load_503s=1),
          _rec("burst", "donor0", {"loads_failed": 2, "lost_leases": 1},
               {"loads_failed": 4, "loads_requeued": 2, "lost_leases": 1, "reclaims": 1},
               leases_from_target=1, target_reclaims=1)]
    assert consistency(ok, leases_seen=1)["failed_loads"] == ""
    bad = [_rec("traffic", after={"loads_failed": 1}, load_503s=1),
           _rec("freeze", "donor0", after={"loads_failed": 1}, load_503s=1),
           _rec("freeze", BORROWER, after={"loads_failed": 1}),
           _rec("kill", "donor0", load_503s=2),
           _rec("traffic", after={"loads_failed": 1, "loads_requeued": 1})]
    checks = consistency(bad, leases_seen=1)["failed_loads"]
    assert checks.count("no fault to explain it") == 3
    assert ("step 2 freeze borrower: 1 loads failed on the borrower, 0 requests requeued and 0 "
            "answered 503") in checks
    assert ("step 3 kill donor0: 0 loads failed on the borrower, 0 requests requeued and 2 "
            "answered 503") in checks


def test_ask_tells_a_failed_donor_load_from_other_http_errors():
    """SwiftCache's 503 for a failed donor load is retryable ("load_failed"); another 503 or
    another status is an error."""
    import io
    import urllib.error

    from benchmarks.tools.chaos_replay import LOAD_FAILED, ask

    class Server:
        def __init__(self, code, message):
            self.code, self.message = code, message

        def post(self, path, payload, timeout):
            body = io.BytesIO(f'{{"message": "{self.message}"}}'.encode())
            raise urllib.error.HTTPError(path, self.code, "x", {}, body)

    assert ask(Server(503, LOAD_FAILED + " (lease fenced)"), {}, 1.0)[0] == "load_failed"
    assert ask(Server(503, "server overloaded"), {}, 1.0)[0] == "error"
    assert ask(Server(500, LOAD_FAILED), {}, 1.0)[0] == "error"


def test_consistency_names_each_contradiction():
    """An unacknowledged burst, a reclaim without a burst, a kill without a loss, a 503 the
    borrower did not count, a refused load while all were alive, fewer leases counted than
    seen, and an unused donor tier are named."""
    records = [
        _rec("burst", "donor0", leases_from_target=1, target_reclaims=1),
        _rec("idle", after={"reclaims": 1}),
        _rec("kill", "donor1", leases_from_target=2),
        _rec("traffic", load_503s=1),
        _rec("freeze", "donor0", after={"refused_loads": 1, "loaded_tokens": 0}),
    ]
    checks = consistency(records, leases_seen=3)
    assert "borrower acknowledged 0" in checks["reclaims"]
    assert "reclaims without a burst" in checks["reclaims"]
    assert "none counted lost" in checks["lost_leases"]
    assert "1 loads" in checks["refused_copies"]
    assert "0 loads failed on the borrower, 0 requests requeued and 1 answered 503" in \
        checks["failed_loads"]
    assert "< 3 leases seen" in checks["leases"]
    assert checks["donor_tier_used"]


def test_fault_counts_skip_aborted_steps():
    """`faults` reports what was injected: a step that could not be carried out is not counted."""
    records = [_rec("traffic"), _rec("kill", "donor0"), _rec("restart", "donor0"),
               StepRecord(Step("burst", "donor0"), {}, {}, aborted="HTTPError")]
    assert fault_counts(records) == {"freeze": 0, "idle": 0, "burst": 0, "kill": 1,
                                     "restart": 1}


def test_faults_on_empty_tier_names_faults_that_put_no_data_at_risk():
    """A freeze, idle, burst or kill that met an empty donor tier is named; traffic and
    restarts are not faults on data."""
    tier = "donor_tier_tokens"
    records = [StepRecord(Step("freeze", "donor0", 3.0, 1), {tier: 0}, {tier: 40}),
               StepRecord(Step("kill", "donor0"), {tier: 40}, {tier: 0}),
               StepRecord(Step("restart", "donor0"), {tier: 0}, {tier: 0}),
               StepRecord(Step("idle", seconds=3.0), {tier: 0}, {tier: 0})]
    assert faults_on_empty_tier(records) == ["step 0 freeze donor0 3s +1 req", "step 3 idle 3s"]


def test_replay_orders_groups_round_robin_and_carries_stock_answers():
    """Within a group conversations alternate turn by turn, groups follow one another (histories
    never grow past `turns`), and a request's history holds stock's answers to earlier turns."""
    from benchmarks.tools.chaos_replay import Replay
    from benchmarks.workloads.sharegpt import Conversation, Turn

    convs = [Conversation(str(i), tuple(Turn(f"c{i}t{t}", "") for t in range(3)))
             for i in range(3)]
    replay = Replay(convs, group=2, turns=2, max_tokens=4)
    assert replay.keys == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]
    assert Replay.groups_for(7, group=2, turns=2) == 2
    replay.reference[(0, 0)] = "stock says"
    assert replay.messages((0, 1)) == [{"role": "user", "content": "c0t0"},
                                       {"role": "assistant", "content": "stock says"},
                                       {"role": "user", "content": "c0t1"}]
