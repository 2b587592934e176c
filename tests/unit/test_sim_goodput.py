"""Goodput and the SLO: the search, the unloaded-TTFT reference, and memory per tier as run."""

from dataclasses import replace

import pytest

from benchmarks.simulator import experiments as ex
from benchmarks.simulator import goodput as gp
from benchmarks.simulator import params
from benchmarks.simulator.roofline import Roofline
from benchmarks.simulator.scenario import PAPER, master_memory_bytes, run_point
from benchmarks.workloads.token_traces import TokenSession, TokenTurn


def _capacity(cap: float):
    """Metrics of a server that keeps P99 TTFT at 10 ms up to `cap` sessions/s and 100 s beyond."""
    return lambda rate: {"ttft_p99": 0.01 if rate <= cap else 100.0, "stable": rate <= cap}


def test_goodput_bisects_between_the_last_sustained_and_first_failing_rate():
    """Goodput lies within the bisection's resolution below the true capacity, never above it."""
    g = gp.goodput(_capacity(0.7), (0.25, 0.5, 1.0), slo_s=5.0, refine_steps=4)
    assert 0.7 - 0.5 / 16 <= g.rate <= 0.7 and not g.lower_bound


def test_goodput_ignores_a_sustained_rate_above_a_failing_one():
    """A rate counts only if every lower swept rate was sustained too (a fluke above a failure is
    not goodput)."""
    fluke = {0.25: True, 0.5: False, 1.0: True}
    g = gp.goodput(lambda r: {"ttft_p99": 1.0, "stable": fluke.get(r, False)}, fluke, 5.0,
                   refine_steps=0)
    assert g.rate == 0.25


def test_goodput_flags_a_grid_that_never_fails_and_a_first_rate_that_fails():
    """All rates sustained: the top rate, marked as a lower bound; the lowest failing: 0 after
    bisection down."""
    assert gp.goodput(_capacity(9.0), (0.5, 1.0), 5.0, 3) == gp.Goodput(1.0, True, 5.0)
    g = gp.goodput(_capacity(0.1), (0.5, 1.0), 5.0, 3)
    assert g.rate <= 0.1 and not g.lower_bound


def test_sustained_needs_the_slo_and_a_queue_that_does_not_grow():
    """Within the SLO but unstable, or stable but over the SLO, is not sustained."""
    assert gp.sustains({"ttft_p99": 1.0, "stable": True}, 2.0)
    assert not gp.sustains({"ttft_p99": 1.0, "stable": False}, 2.0)
    assert not gp.sustains({"ttft_p99": 3.0, "stable": True}, 2.0)


def test_unloaded_ttft_is_chunked_prefill_over_cached_history_with_the_shared_prompt_cached():
    """Each turn's unloaded TTFT is the roofline time of its new tokens in 8192-token chunks after
    its history; a shared system prompt is not prefilled again."""
    m = params.MODELS[PAPER.master]
    hw = params.gpu(PAPER.gpu)
    rl = Roofline(m, hw["bf16_flops"], hw["hbm_bw"], 0.6, 0.7)
    s = TokenSession(0, 0.0, (TokenTurn(1000 + 9000, 10, 0.0), TokenTurn(50, 5, 0.0)),
                     shared_prefix_tokens=1000)
    got = gp.unloaded_ttfts(PAPER, PAPER.master, [s])
    first = rl.step_time([(8192, 1000)]) + rl.step_time([(808, 1000 + 8192)])
    assert got == [pytest.approx(first), pytest.approx(rl.step_time([(50, 1000 + 9000 + 10)]))]


def test_master_slo_is_the_factor_times_the_unloaded_p99():
    """The SLO scales with the factor (the unloaded reference is the same traffic either way)."""
    assert gp.master_slo_s(PAPER, factor=10.0) == pytest.approx(
        2 * gp.master_slo_s(PAPER, factor=5.0))


def test_donor_goodputs_find_each_donors_own_capacity(monkeypatch):
    """Doubling then bisection finds every donor's capacity within the last step, from one run
    per step."""
    caps = {f"donor{i + 1}:{d}": c for i, (d, c) in enumerate(zip(PAPER.donors, (1.3, 3.1, 6.2)))}
    calls = []

    def fake_run_point(scn, system, rate, window, **kw):
        calls.append(kw["donor_rates"])
        donors = {n: _capacity(c)(r) for (n, c), r in zip(caps.items(), kw["donor_rates"]) if r > 0}
        return type("R", (), {"donors": donors})()

    monkeypatch.setattr(gp, "run_point", fake_run_point)
    found, slos = gp.donor_goodputs(PAPER, 60.0, refine_steps=3, start_rate=0.5)
    for got, cap in zip(found, caps.values()):
        # within the last bisection step of its [cap/2, 2 cap] bracket
        assert cap / 2 ** 0.5 <= got <= cap
    assert len(calls) <= 8 and all(s > 0 for s in slos)


def test_memory_per_tier_is_what_the_run_has():
    """The donor tier reported is exactly what Node.lend grants in a run; equal fast memory gives
    HiCache a host tier of SwiftCache's donor + host; the paper setup's host tiers are equal."""
    swift = master_memory_bytes(PAPER, "swiftcache")
    run = run_point(replace(PAPER, drain_s=0.0), "swiftcache", 0.01, 1.0)
    page_bytes = 64 * params.MODELS[PAPER.master].kv_bytes_per_token
    page = swift["device"] / (swift["device"] // page_bytes)
    assert swift["donor"] == run.lent_blocks * page
    assert master_memory_bytes(PAPER, "sglang-hicache") == {**swift, "donor": 0}
    big = master_memory_bytes(PAPER, "sglang-hicache-bighost")
    assert big["host"] == swift["host"] + swift["donor"] and big["donor"] == 0


class _Points(ex.Points):
    def __init__(self, table):
        super().__init__(PAPER, 60.0)
        self.table, self.asked = table, []

    def master(self, system, rate):
        self.asked.append((system, rate))
        return self.table[system](rate)


def test_compare_reads_both_systems_at_the_baselines_goodput_rate():
    """The P99 reduction compares both systems at the highest rate the baseline sustains."""
    pts = _Points({"swiftcache": lambda r: {"ttft_p99": 2.0},
                   "sglang-hicache": lambda r: {"ttft_p99": 4.0}})
    found = {"swiftcache": gp.Goodput(0.9, False, 7.0),
             "sglang-hicache": gp.Goodput(0.6, False, 7.0)}
    c = ex.compare(pts, found, "sglang-hicache")
    assert c["goodput_ratio_vs_hicache"] == pytest.approx(1.5)
    assert c["p99_ttft_reduction_at_stable"] == pytest.approx(0.5)
    assert set(pts.asked) == {("sglang-hicache", 0.6), ("swiftcache", 0.6)}
