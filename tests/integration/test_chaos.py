"""A short chaos run against live servers (benchmarks/tools/chaos.py; docs/chaos.md).

Real SGLang CPU servers: a busy borrower (small model, 384-token pool), one donor (tiny model)
and stock SGLang on the borrower's model and pool as the reference. One fault cycle: the donor
frozen past the heartbeat timeout while the borrower serves, the borrower idle, the borrower
frozen with a request in flight, a donor burst that reclaims, the donor SIGKILLed and restarted.
Invariants:
- every answer of the borrower equals stock SGLang's for the same request (no wrong token);
- every request is answered within the bound, without an HTTP error (no hang, no error); a
  503 for a failed donor load is retried, like a client, and its answer compared too;
- nothing in donor memory is lost while both processes are alive (a freeze or an idle costs no
  lease and no cached token; only the kill does);
- the borrower's swiftcache_* counters agree with what the run did: leases counted, the burst's
  reclaim completed on the donor and acknowledged by the borrower, the kill cost a lease, no copy
  refused outside a burst or a kill, each 503 one failed load on the borrower (and the reverse)
  in a step whose fault explains it, tokens loaded back from donor memory;
- the freezes and the idle phase met a borrower with data in donor memory, and the burst and the
  kill a donor it borrowed from (each fault tested something).
"""

from __future__ import annotations

import pytest

from benchmarks.tools.chaos import ChaosOptions, run_chaos

pytestmark = pytest.mark.integration


def test_short_chaos_run_is_token_identical_to_stock_and_loses_nothing_while_alive(tmp_path):
    result = run_chaos(ChaosOptions(donors=1, cycles=1, per_slot=2, conversations=6,
                                    out=tmp_path / "chaos"))
    details = result["details"]
    assert result["wrong_tokens"] == 0, details["wrong"]
    assert result["hangs"] == 0 and result["errors"] == 0, (details["hangs"], details["errors"])
    assert result["answered"] == result["requests"] > 0
    assert not result["aborted_steps"], result["aborted_steps"]
    assert result["faults_by_kind"] == {"freeze": 2, "idle": 1, "burst": 1, "kill": 1,
                                        "restart": 1}
    assert result["lost_idle_tokens"] == 0 and result["lost_leases_while_alive"] == 0, \
        details["borrower_lost_lines"]
    assert result["inconsistent"] == {}, result["inconsistent"]
    untested = [f for f in result["faults_on_empty_tier"] if "freeze" in f or "idle" in f]
    assert not untested, f"faults that met an empty donor tier: {untested}"
    # the burst and the kill hit a donor the borrower borrowed from, so their checks applied
    for rec in result["records"]:
        if rec["step"].startswith(("burst", "kill")):
            assert rec["leases_from_target"] >= 1, rec
