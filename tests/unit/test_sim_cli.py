"""simulate --quick's contract: tables on disk and a last-line JSON whose keys say what they
hold."""

import json
from dataclasses import replace

from benchmarks.simulator import cli
from benchmarks.simulator.scenario import PAPER


def test_quick_prints_goodput_and_stable_rate_figures_for_both_comparisons(tmp_path, monkeypatch,
                                                                           capsys):
    """The last line is JSON labeled simulated; each comparison (paper setup, equal fast memory) has
    goodput_ratio_vs_hicache and p99_ttft_reduction_at_stable with the memory per tier beside them;
    equal fast memory means the baseline's host tier holds SwiftCache's donor + host; interference
    is given per donor load share; the old best-over-all-rates key is gone."""
    monkeypatch.setattr(cli, "QUICK", dict(rates=(0.5, 1.0, 2.0), window=60.0, refine_steps=2,
                                           donor_refine_steps=1, shares=(0.25, 0.5),
                                           slo_factors=(5.0,)))
    monkeypatch.setitem(cli.SCENARIOS, PAPER.name, replace(PAPER, drain_s=120.0))
    monkeypatch.setattr(cli.gp, "donor_goodputs",
                        lambda scn, *a, **k: ([0.5, 0.5, 0.5], [1.0, 1.0, 1.0]))
    cell = {"cell": "chat/think60/turns4/host32.6/pcie32", "goodput_ratio_vs_hicache": 1.0,
            "p99_ttft_reduction_at_80pct": 0.0}  # its own test: test_sim_regime.py
    monkeypatch.setattr(cli.regime_cli, "capacity_regime", lambda *a, **k: cell)
    assert cli.main(["--quick", "--out", str(tmp_path)]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["capacity_regime"] == cell
    assert s["simulated"] is True
    assert "p99_ttft_reduction_vs_hicache" not in json.dumps(s)
    assert set(s["comparisons"]) == {"paper_setup", "equal_fast_memory"}
    for c in s["comparisons"].values():
        g = c["goodput_sessions_per_s"]
        assert c["goodput_ratio_vs_hicache"] == round(g["swiftcache"] / g[c["baseline"]], 4)
        assert c["p99_ttft_reduction_at_stable"] is None or c["p99_ttft_reduction_at_stable"] < 1.0
        assert c["stable_rate_sessions_per_s"] == g[c["baseline"]]
        assert set(c["memory_gb"]["swiftcache"]) == {"device", "donor", "host"}
    paper, equal = s["comparisons"]["paper_setup"], s["comparisons"]["equal_fast_memory"]
    swift = paper["memory_gb"]["swiftcache"]
    assert paper["memory_gb"]["sglang-hicache"]["host"] == swift["host"] and swift["donor"] > 0
    big = equal["memory_gb"]["sglang-hicache-bighost"]
    assert abs(big["host"] - (swift["donor"] + swift["host"])) <= 0.02 and big["donor"] == 0
    assert set(s["donor_interference_by_load_share"]) == {"0.25", "0.5"}
    assert s["donor_interference"] == s["donor_interference_by_load_share"]["0.5"] >= 0.0
    for share, worst in s["donor_interference_by_load_share"].items():  # the worse of the two P99s
        assert worst == max(0.0, s["donor_p99_ttft_change_by_load_share"][share],
                            s["donor_p99_tpot_change_by_load_share"][share])
    assert s["max_context_ratio"] > 1.0
    assert "SIMULATED" in (tmp_path / "tables.md").read_text()
    assert (tmp_path / "p99_ttft_vs_rate_paper-4xH20_chat.png").stat().st_size > 0


def test_a_full_run_must_start_with_the_headline_scenario():
    """--scenarios names known scenario/workload keys with the summary's one first; others are
    refused with the list of choices."""
    import pytest

    for bad in ("8xH100/chat", "paper-4xH20/agent,paper-4xH20/chat",
                "paper-4xH20/chat,nowhere/chat"):
        with pytest.raises(SystemExit, match="give paper-4xH20/chat first"):
            cli._plan_keys(cli.build_parser().parse_args(["--scenarios", bad]))
    a = cli.build_parser().parse_args([])
    assert cli._plan_keys(a) == list(cli.FULL_DEFAULT)
