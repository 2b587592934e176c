"""simulate --quick's contract: tables on disk and a last-line JSON with the three target keys."""

import json

from sglang_swift.simulator import cli


def test_quick_prints_the_summary_json_last(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "QUICK", dict(rates=(1.0, 2.0), window=60.0))
    assert cli.main(["--quick", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    s = json.loads(last)
    assert s["simulated"] is True
    assert 0.0 <= s["p99_ttft_reduction_vs_hicache"] <= 1.0
    assert 0.0 <= s["donor_interference"] <= 1.0
    assert s["max_context_ratio"] > 1.0
    assert "SIMULATED" in (tmp_path / "tables.md").read_text()
    assert (tmp_path / "p99_ttft_vs_rate_paper-4xH20_chat.png").stat().st_size > 0
