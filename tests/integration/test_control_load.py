"""Load: 8 agent processes (2 donors under memory pressure, 6 borrowers churning) run more
than 10,000 lease operations, and no block is ever granted to two holders at once.

Every arena block starts with a claim word that a borrower sets while holding the block and
clears before releasing or acknowledging it; a grant of a block whose claim is set, or a block
handed back to a donor's owner with its claim set, is reported as a violation."""

from __future__ import annotations

import pytest

from benchmarks.peers.peer_process import SimGroup

pytestmark = pytest.mark.integration

DONORS, BORROWERS, OPS_EACH = 2, 6, 1800


def _run(sims: SimGroup, ops_each: int, *donor_flags: str):
    donors = [
        sims.start(
            f"donor{i}",
            "--donate",
            "96",
            "--reoffer",
            "--pressure",
            "6",
            "--quiet-events",
            *donor_flags,
        )
        for i in range(DONORS)
    ]
    borrowers = [sims.start(f"borrower{i}", "--quiet-events") for i in range(BORROWERS)]
    names = [d.agent_id for d in donors]
    for b in borrowers:
        b.status_until(lambda st: {q["agent_id"] for q in st["peers"]} >= set(names), 20)
    for i, b in enumerate(borrowers):
        b.send("churn", ops=ops_each, donors=names, seed=i, max_held=48)
    done = [b.wait_for(lambda e: e["ev"] == "churn_done", 180) for b in borrowers]
    return donors, borrowers, done


def test_eight_agents_ten_thousand_operations_no_double_grant():
    """No block is ever held by two borrowers, nor given back to its owner while held."""
    sims = SimGroup()
    try:
        donors, borrowers, done = _run(sims, OPS_EACH)
        ops = sum(d["grants"] + d["denied"] + d["releases"] + d["acks"] for d in done)
        grants = sum(d["grants"] for d in done)
        assert ops >= 10_000 and grants >= 2_000, done
        reclaims = sum(d.status()["counters"].get("reclaims", 0) for d in donors)
        assert reclaims >= 20, "the donors' own demand must have reclaimed under load"
        print(f"{ops} lease operations, {grants} grants, {reclaims} reclaims")

        for b in borrowers:
            b.send("release_all")
        for d in donors:
            d.status_until(lambda st: st["lent"] == 0, 20)
        for proc in donors + borrowers:
            assert proc.ask("integrity", "integrity")["ok"], proc.agent_id
            assert not proc.violations(), (proc.agent_id, proc.violations()[:3])
            assert proc.status()["counters"].get("grants_refused", 0) == 0
    finally:
        sims.close()


def test_negative_control_a_donor_reusing_before_the_ack_is_caught():
    """The double-grant check is sharp: a donor that reuses reclaimed blocks is caught."""
    sims = SimGroup()
    try:
        donors, borrowers, _ = _run(sims, 300, "--unsafe-early-return")
        assert any(p.violations() for p in donors + borrowers)
    finally:
        sims.close()
