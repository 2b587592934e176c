"""Tensor parallelism across donation in live servers, against stock SGLang at the same TP:
a `--tp 2` borrower with a `--tp 1` donor, and a `--tp 1` borrower with a `--tp 2` donor; with
SWIFTCACHE_LONG_TESTS=1 also a `--tp 2` borrower with a `--tp 2` donor and a borrower rank that
dies (SGLang takes the borrower down; the donor's ledger takes back every block it held).

Real SGLang CPU servers, all on the tiny model (4 layers, 2 KV heads of 32: one head per rank
of a TP 2 server, so a borrower's page and the donor's page differ in shape). One module, each
topology started once inside its test (one server set at a time), references from stock
servers that stop before the next set starts, few requests (the TP recipe: one core per rank,
`SGLANG_CPU_OMP_THREADS_BIND`). Invariants (docs/integration.md "Tensor parallelism"):
- only rank 0 of a TP server runs a control agent, and the borrower takes a lease from the
  donor (`ctl status`), which every rank of a TP borrower applies (each logs the lease); a TP
  donor's ranks each lend from their own pool, and the TP 1 borrower maps both (its lease
  names donor ranks 0 and 1);
- the borrower's greedy outputs equal stock SGLang's at the same TP, turn by turn
  (`same_greedy`, as in test_donation_e2e), with more cached tokens than stock: every rank
  stored and loaded its own shard of each prefix it kept in donor memory; rank 0 of a TP
  borrower put its agent's wake into SGLang's idle sleeper (`--sleep-on-idle`, LocalServer's CPU
  args), so an idle borrower acknowledges a reclaim within a loop (timed in
  `tests/unit/test_tp_wake.py`);
- a burst of the donor's own traffic reclaims every lent page mid-run: the borrower (every
  rank of it) fences and revokes it before the acknowledgement, the donor's pool is whole again
  (on every rank), and the borrower stays token-identical afterwards;
- the TP 2 borrower has a host tier too (HiCache's options, write_back): before the
  acknowledgement every rank reads its shard of the reclaimed blocks and moves it into its own
  host pool, and the reclaimed prefixes are then served from host (docs/hierarchy.md).
"""

from __future__ import annotations

import os
import time

import pytest
from integration.harness import LocalServer, metric, same_greedy, wait_for
from integration.test_donation_e2e import _cached, _donor_burst, _replay

from benchmarks.tools.demo import wait_for_lease
from benchmarks.tools.local_server import serving
from benchmarks.workloads.sharegpt import load_conversations

pytestmark = pytest.mark.integration
TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank; without it SGLang refuses
SMALL_POOL = 450  # tokens: the conversations' histories do not fit, so the tree must evict
DONOR_POOL = 4096
STARTUP_S = 420  # two ranks on a loaded 2-core machine took up to 175 s to come up
MAX_TIES = 1  # stock SGLang's own CPU kernels can flip a near-tie between its runs
CONVERSATIONS, TURNS, TAIL_TURNS = 4, 3, 4
HOST_TIER = ["--enable-hierarchical-cache", "--hicache-write-policy", "write_back",
             "--hicache-ratio", "2", "--hicache-mem-layout", "layer_first"]


def _tp2(model, log_path, *extra: str, swiftcache: bool = True) -> LocalServer:
    return LocalServer(model, swiftcache=swiftcache, max_total_tokens=SMALL_POOL,
                       env={**os.environ, **TP_ENV}, log_path=log_path,
                       startup_timeout_s=STARTUP_S,
                       extra_args=["--tp", "2", "--dtype", "float32", "--enable-cache-report",
                                   *extra])


def _swift_args(rendezvous: str, role: str, *extra: str) -> list[str]:
    return ["--swiftcache-role", role, "--swiftcache-rendezvous-dir", rendezvous,
            # a loaded 2-core machine can starve the agent thread for a second or more
            "--swiftcache-heartbeat-timeout-s", "3", "--swiftcache-heartbeat-interval-s", "0.3",
            *extra]


def _check(got, want) -> None:
    ties = same_greedy(got, want)
    assert len(ties) <= MAX_TIES, f"near-ties at requests {ties}: more than float noise explains"


@pytest.fixture(scope="module")
def convs():
    return load_conversations(CONVERSATIONS, min_turns=TAIL_TURNS, max_chars_per_message=200)


@pytest.fixture(scope="module")
def stock(tiny_model, convs, tmp_path_factory):
    """Stock SGLang --tp 2 with the small pool: the reference answers (then it stops)."""
    with _tp2(tiny_model, tmp_path_factory.mktemp("stock") / "stock.log",
              swiftcache=False) as server:
        return _replay(server, convs, TURNS), _replay(server, convs[:2], TAIL_TURNS)


@pytest.fixture(scope="module")
def stock_tp1(tiny_model, convs, tmp_path_factory):
    """Stock SGLang --tp 1 with the small pool: the TP 1 borrower's reference answers."""
    with LocalServer(tiny_model, swiftcache=False, max_total_tokens=SMALL_POOL,
                     log_path=tmp_path_factory.mktemp("stock1") / "stock.log",
                     extra_args=["--dtype", "float32", "--enable-cache-report"]) as server:
        return _replay(server, convs, TURNS), _replay(server, convs[:2], TAIL_TURNS)


def _donor(model, tmp, rendezvous: str, *tp: str) -> LocalServer:
    """A donor that lends half its pool and keeps half free for itself, lending no more after a
    reclaim (so the reclaim takes every lent page back)."""
    return LocalServer(model, max_total_tokens=DONOR_POOL, log_path=tmp / "donor.log",
                       env={**os.environ, **TP_ENV} if tp else None,
                       startup_timeout_s=STARTUP_S,
                       extra_args=[*tp, "--dtype", "float32", *_swift_args(
                           rendezvous, "donor", "--swiftcache-lend-fraction", "0.5",
                           "--swiftcache-reclaim-watermark", "0.5",
                           "--swiftcache-relend-cooldown-s", "600", "--enable-metrics")])


def _served_with_more_hits(borrower, convs, ref) -> None:
    started = time.monotonic()
    got = _replay(borrower, convs, TURNS, forced=ref)
    _check(got, ref)
    assert _cached(got) > _cached(ref), (_cached(got), _cached(ref))
    loaded = wait_for(lambda: metric(borrower, "swiftcache_loaded_tokens_total"), 30,
                      "swiftcache metrics on the borrower's /metrics")
    print(f"{len(got)} requests in {time.monotonic() - started:.1f} s, cached "
          f"{_cached(got)} vs stock {_cached(ref)}, loaded {loaded:.0f} tokens")


def _reclaimed_mid_run(donor, borrower, convs, ref_tail, borrower_ranks,
                       rescued: bool = False) -> None:
    """The donor's burst runs while the borrower serves: the reclaim lands mid-replay. With
    `rescued` (a host tier) every rank moves the reclaimed prefixes into its host pool, and
    they are hit in host afterwards."""
    import threading

    burst = threading.Thread(target=_donor_burst, args=(donor,))
    burst.start()
    got = _replay(borrower, convs[:2], TAIL_TURNS, forced=ref_tail)
    burst.join(300)
    wait_for(lambda: metric(donor, "swiftcache_reclaim_latency_seconds_count") >= 1, 60,
             "the donor's lent pages to come back into its own pool")
    wait_for(lambda: metric(donor, "swiftcache_lent_tokens") == 0, 30,
             "every lent page back in the donor's pool")
    log = borrower.log_text().splitlines()
    for rank in borrower_ranks:
        assert any("reclaimed" in line and rank in line for line in log), \
            f"rank {rank} did not apply the reclaim"
    _check(got, ref_tail)
    if rescued:
        for rank in borrower_ranks:
            assert any("reclaimed donor pages into the host tier" in line and rank in line
                       for line in log), f"rank {rank} did not move its shard into host"
        host_hits = metric(borrower, "swiftcache_host_hit_tokens_total") or 0
        assert metric(borrower, "swiftcache_rescued_tokens_total") > 0
    _check(_replay(borrower, convs[:2], TAIL_TURNS, forced=ref_tail), ref_tail)  # after it
    if rescued:
        wait_for(lambda: (metric(borrower, "swiftcache_host_hit_tokens_total") or 0) > host_hits,
                 30, "host hits after the reclaim")
    for server in (donor, borrower):
        assert server.proc.poll() is None, server.log_tail()


def _runtimes_started(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if "SwiftCache runtime" in line and "started" in line]


def test_tp2_borrower_with_a_tp1_donor_is_token_identical_to_stock_tp2(tiny_model, stock,
                                                                        convs, tmp_path):
    ref, ref_tail = stock
    rendezvous = str(tmp_path / "rv")
    borrower = _tp2(tiny_model, tmp_path / "borrower.log", "--enable-metrics", *_swift_args(
        rendezvous, "borrower", "--swiftcache-max-borrow-blocks", "1500"), *HOST_TIER)
    donor = _donor(tiny_model, tmp_path, rendezvous)
    with serving(donor, borrower):
        wait_for_lease(rendezvous, timeout_s=120)
        leased = wait_for(lambda: [line for line in borrower.log_text().splitlines()
                                   if "SwiftCache: borrowing" in line], 30,
                          "the borrower's scheduler to apply the lease")
        log = borrower.log_text()
        assert any("TP0" in line for line in leased) and any("TP1" in line for line in leased), \
            "both ranks apply the lease"
        assert len(_runtimes_started(log)) == 2, "a runtime on each rank"
        woke = [line for line in log.splitlines() if "wake of the scheduler loop" in line]
        assert len(woke) == 1 and "TP0" in woke[0] and "registered on the idle sleeper's " \
            "poller" in woke[0], woke  # rank 0's agent wakes its idle loop for a reclaim
        _served_with_more_hits(borrower, convs, ref)
        _reclaimed_mid_run(donor, borrower, convs, ref_tail, ("TP0", "TP1"), rescued=True)


def test_tp1_borrower_with_a_tp2_donor_is_token_identical_to_stock_tp1(tiny_model, stock_tp1,
                                                                        convs, tmp_path):
    ref, ref_tail = stock_tp1
    rendezvous = str(tmp_path / "rv")
    borrower = LocalServer(tiny_model, max_total_tokens=SMALL_POOL,
                           log_path=tmp_path / "borrower.log",
                           extra_args=["--dtype", "float32", "--enable-cache-report",
                                       "--enable-metrics", *_swift_args(
                                           rendezvous, "borrower",
                                           "--swiftcache-max-borrow-blocks", "1500")])
    donor = _donor(tiny_model, tmp_path, rendezvous, "--tp", "2")
    with serving(donor, borrower):
        wait_for_lease(rendezvous, timeout_s=120)
        started = _runtimes_started(donor.log_text())
        assert len(started) == 2 and all("lends up to 0 " not in line for line in started), \
            "each donor rank lends from its own pool"
        leased = wait_for(lambda: [line for line in borrower.log_text().splitlines()
                                   if "SwiftCache: borrowing" in line], 30,
                          "the borrower's scheduler to apply the lease")
        assert all("(donor ranks 0, 1 of 2)" in line for line in leased), leased
        _served_with_more_hits(borrower, convs, ref)
        _reclaimed_mid_run(donor, borrower, convs, ref_tail, ("",))


LONG_TESTS = os.environ.get("SWIFTCACHE_LONG_TESTS") == "1"


def _rank_process(server: LocalServer, rank: int):
    """The scheduler process of `rank` among the server's descendants (SGLang names it
    `sglang::scheduler_TP<rank>`)."""
    import psutil

    name = f"sglang::scheduler_TP{rank}"
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if name in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no {name} process under the server (pid {server.proc.pid})")


@pytest.mark.skipif(not LONG_TESTS, reason="four TP ranks on a two-core machine: about three "
                    "minutes more for CI; SWIFTCACHE_LONG_TESTS=1 runs it")
def test_tp2_borrower_with_a_tp2_donor_and_a_dead_borrower_rank(tiny_model, stock, convs,
                                                                  tmp_path):
    """TP 2 with TP 2: each borrower rank maps the donor rank of its own index; outputs equal
    stock TP 2's through a reclaim mid-run. Then, lent again, the borrower's rank 1 dies:
    SGLang takes the whole borrower down, and the donor reclaims every page it held (on both
    of its ranks) and keeps serving."""
    ref, ref_tail = stock
    rendezvous = str(tmp_path / "rv")
    borrower = _tp2(tiny_model, tmp_path / "borrower.log", "--enable-metrics", *_swift_args(
        rendezvous, "borrower", "--swiftcache-max-borrow-blocks", "1500"))
    donor = LocalServer(tiny_model, max_total_tokens=DONOR_POOL, log_path=tmp_path / "donor.log",
                        env={**os.environ, **TP_ENV}, startup_timeout_s=STARTUP_S,
                        extra_args=["--tp", "2", "--dtype", "float32", *_swift_args(
                            rendezvous, "donor", "--swiftcache-lend-fraction", "0.5",
                            "--swiftcache-reclaim-watermark", "0.5",
                            "--swiftcache-relend-cooldown-s", "20", "--enable-metrics")])
    with serving(donor, borrower):
        wait_for_lease(rendezvous, timeout_s=180)
        leased = wait_for(lambda: [line for line in borrower.log_text().splitlines()
                                   if "SwiftCache: borrowing" in line], 60,
                          "the borrower's scheduler to apply the lease")
        assert any("TP0" in line for line in leased) and any("TP1" in line for line in leased), \
            leased
        _served_with_more_hits(borrower, convs, ref)
        _reclaimed_mid_run(donor, borrower, convs, ref_tail, ("TP0", "TP1"))
        # after the cooldown the idle donor offers pages again and the borrower takes a lease
        wait_for_lease(rendezvous, timeout_s=180)
        _rank_process(borrower, 1).kill()
        borrower.proc.wait(120)  # SGLang's launcher takes the whole server down
        # the donor's ledger takes back every block the dead borrower held (they are its
        # offered pages again: its own traffic gets them without asking anybody)
        wait_for(lambda: _grants(rendezvous) == [], 60,
                 "the donor to take back what the dead borrower held")
        assert "lost" in donor.log_text()
        _donor_burst(donor)  # the donor serves its own traffic
        assert donor.proc.poll() is None, donor.log_tail()


def _grants(rendezvous: str):
    """The leases and granted blocks `ctl status` reports for the agents still up (None
    while ctl cannot answer)."""
    import json

    from benchmarks.tools.demo import ctl

    try:
        agents = json.loads(ctl(rendezvous, json_out=True))
    except ValueError:
        return None
    return [(a["agent_id"], a.get("lent"), a.get("leases")) for a in agents
            if isinstance(a, dict) and a.get("state", "up") == "up"
            and (a.get("leases") or a.get("lent"))]
