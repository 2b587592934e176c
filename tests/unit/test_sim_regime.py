"""The regime grid's pieces: cells map their knobs onto the scenario, the goodput search, the live
KV measure, the per-seed reduction, and the live tiers' write-through and reclaim rescue in the
simulator's tree."""

from array import array

import pytest

from benchmarks.simulator import regime as rg
from benchmarks.simulator import regime_cli
from benchmarks.simulator.cache_adapter import TreeCache
from benchmarks.simulator.capacity import lendable_pages, master_tier_pages, page_bytes
from benchmarks.simulator.cli import build_parser
from benchmarks.simulator.run_metrics import peak_live_tokens
from benchmarks.simulator.scenario import PAPER
from benchmarks.simulator.server import SimRequest
from radix_ext import DONOR, HOST


def test_a_cell_sets_think_turns_host_and_pcie_and_agent_cells_set_the_tool_time():
    """Chat cells set the think time, agent cells the tool time; host GB and PCIe GB/s reach the
    scenario in bytes; the key names every knob."""
    chat = rg.Cell("chat", 60.0, 4, 65.0, 8.0).scenario()
    assert (chat.think_mean_s, chat.min_turns, chat.host_bytes, chat.pcie_bw) == (60.0, 4, 65e9,
                                                                                 8e9)
    agent = rg.Cell("agent", 30.0, 1, 32.6, 32.0).scenario()
    assert agent.tool_latency_s == 30.0 and agent.think_mean_s == PAPER.think_mean_s
    assert rg.Cell("chat", 60.0, 4, 32.6, 32.0).key == "chat/think60/turns4/host32.6/pcie32"


def test_the_grid_has_every_chat_combination_and_one_turns_value_for_agents():
    """3 x 2 x 3 x 3 chat cells and 3 x 3 x 3 agent cells; the realistic cell is among them."""
    cells = rg.cells()
    assert sum(c.workload == "chat" for c in cells) == 54
    assert sum(c.workload == "agent" for c in cells) == 27
    assert rg.REALISTIC in cells


def test_the_ideal_holds_the_lease_in_its_device_pool_and_host_follows_the_cell():
    """The ideal's device pool is HiCache's plus every donor's lease; a cell's host GB sets the
    host pages of every system with a host tier."""
    scn = rg.Cell("chat", 10.0, 1, 65.0, 32.0).scenario()
    lent = sum(lendable_pages(scn, scn.lend_fraction))
    h, i = master_tier_pages(scn, True, False), master_tier_pages(scn, True, False, ideal=True)
    assert i["device"] == h["device"] + lent and i["host"] == h["host"] and i["donor"] == 0
    assert h["host"] == int(65e9 // page_bytes(scn.master))


@pytest.mark.parametrize("start", [0.05, 0.3, 2.0])
def test_search_finds_the_edge_from_any_start(start):
    """A system that sustains exactly the rates up to 0.37: the goodput is at most 0.37 and
    within the bracket's 1/2^steps of it, whether the start is below or above the edge."""
    at = lambda r: {"ttft_p99": 1.0 if r <= 0.37 else 9.0, "stable": True}  # noqa: E731
    g = rg.search(at, 5.0, start, refine_steps=6)
    assert 0.37 * (1 - 1 / 32) <= g.rate <= 0.37 and not g.lower_bound


def test_search_reports_a_lower_bound_and_zero():
    """No failing rung: a lower bound; no sustained rung: zero."""
    assert rg.search(lambda r: {"ttft_p99": 1.0, "stable": True}, 5.0, 1.0, 2, 3).lower_bound
    assert rg.search(lambda r: {"ttft_p99": 9.0, "stable": True}, 5.0, 1.0, 2, 3).rate == 0.0


def _req(session, turn, arrival, prompt, out, finish):
    r = SimRequest(0, session, turn, arrival, prompt, out, array("q"), array("q"))
    r.finish = finish
    return r


def test_peak_live_tokens_counts_each_session_history_until_it_ends():
    """Session a holds 100 from t=0, then 300 from t=10 until its last turn finishes at 12;
    session b holds 50 over [5, 20): the peak is 350 (at 10 <= t < 12)."""
    reqs = [_req("a", 0, 0.0, 80, 20, 2.0), _req("a", 1, 10.0, 250, 50, 12.0),
            _req("b", 0, 5.0, 40, 10, 20.0)]
    assert peak_live_tokens(reqs, 30.0) == 350


def _stats(x):
    return {"median": x, "min": x, "max": x}


def test_reduce_seeds_takes_medians_and_reductions_against_hicache():
    """Two seeds with goodput ratios 1.5 and 2.5: median 2.0; the P99 reduction at 80% is
    1 - SwiftCache / HiCache per seed."""
    def row(seed, ours, p99):
        share = {s: {"ttft_p99": (p99 if s == rg.OURS else 2.0), "stable": True,
                     "hits": {"device": 0.5}} for s in rg.SYSTEMS}
        return {"seed": seed, "goodput": {rg.HICACHE: 1.0, rg.OURS: ours, rg.IDEAL: 3.0},
                "at_share": {str(f): share for f in rg.LOAD_SHARES},
                "peak_live_tokens_at_hicache_goodput": 1000,
                "prediction": {"device_plus_host": 2000, "device_plus_donor_plus_host": 5000,
                               "rate_filling_device_plus_host": 0.5}}
    out = rg.reduce_seeds([row(0, 1.5, 1.0), row(1, 2.5, 1.5)])
    assert out["goodput_ratio_vs_hicache"] == {"median": 2.0, "min": 1.5, "max": 2.5}
    assert out["p99_ttft_reduction_at_80pct"] == {"median": 0.375, "min": 0.25, "max": 0.5}
    assert out["ideal_goodput_ratio_vs_hicache"] == _stats(3.0)
    assert out["peak_live_over_device_plus_host"] == 0.5


def test_write_through_backs_up_each_insert_in_host_and_copies_it():
    """With write_through every prefix the tree takes gets a host copy at once and the copier is
    handed the device -> host transfers; an eviction then copies nothing new to host."""
    cache = TreeCache(8, host_pages=8, write_through=True)
    copied = []
    cache.copier = copied.extend
    cache.insert(array("q", range(4)), cache.alloc(4))
    assert cache.tier_pages(HOST) == 4 and sum(len(t.dst.indices) for t in copied) == 4
    cache.check_integrity()


def test_a_reclaim_rescues_donor_copies_into_host_and_copies_them():
    """A prefix demoted to donor pages moves to host when the donor takes the lease back (room
    in host); the copier gets the donor -> host transfers; nothing is lost."""
    cache = TreeCache(4, host_pages=8, donor=True)
    cache.add_lease("d", 1, 1, 8)
    moved = []
    cache.copier = moved.extend
    cache.insert(array("q", range(4)), cache.alloc(4))
    plan = cache.tree.evict_device(4)
    for step in plan.steps:  # settle the demotion stores as the server's barrier does
        if hasattr(step, "ticket_id"):
            cache.tree.complete_store(step)
    assert cache.tier_pages(DONOR) == 4
    res = cache.revoke("d", 1, range(8))
    assert cache.tier_pages(HOST) == 4 and res.num_tokens_lost == 0 and not res.lost
    assert moved and all(t.src_tier == DONOR and t.dst_tier == HOST for t in moved)
    cache.check_integrity()


def test_write_through_without_a_host_tier_is_refused():
    with pytest.raises(ValueError, match="host tier"):
        TreeCache(8, host_pages=0, write_through=True)


def test_grid_options_parse_to_tuples():
    """Every knob is a comma-separated option of simulate."""
    a = build_parser().parse_args(["--grid", "--think-s", "10,60", "--min-turns", "4",
                                   "--host-gb", "32.6", "--pcie-gbps", "8,16", "--seeds", "0,1",
                                   "--workloads", "chat"])
    assert (a.think_s, a.min_turns, a.host_gb, a.pcie_gbps, a.seeds, a.workloads) == (
        (10.0, 60.0), (4,), (32.6,), (8.0, 16.0), (0, 1), ("chat",))
    assert len(rg.cells(a.workloads, a.think_s, a.min_turns, a.host_gb, a.pcie_gbps)) == 4
    assert callable(regime_cli.capacity_regime)


def test_the_quick_capacity_figure_comes_from_the_realistic_cell(monkeypatch):
    """`--quick`'s capacity_regime names the cell chosen in the docs (never the best cell) and
    reads its goodput ratio and 80% reduction from that cell's run."""
    seen = []

    def fake(cell, seed, window, refine, say=None):
        seen.append(cell)
        share = {s: {"ttft_p99": (1.0 if s == rg.OURS else 4.0), "stable": True,
                     "hits": {"device": 0.5}} for s in rg.SYSTEMS}
        return {"cell": cell.key, "seed": seed, "goodput": {rg.HICACHE: 0.4, rg.OURS: 0.5,
                                                            rg.IDEAL: 0.9},
                "at_share": {str(f): share for f in rg.LOAD_SHARES},
                "peak_live_tokens_at_hicache_goodput": 100,
                "prediction": {"device_plus_host": 200, "device_plus_donor_plus_host": 500,
                               "rate_filling_device_plus_host": 0.6}}

    monkeypatch.setattr(regime_cli.rg, "evaluate", fake)
    out = regime_cli.capacity_regime(600.0, 0, 3)
    assert seen == [rg.REALISTIC] and out["cell"] == rg.REALISTIC.key
    assert out["goodput_ratio_vs_hicache"] == 1.25 and out["p99_ttft_reduction_at_80pct"] == 0.75
