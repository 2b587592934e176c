"""Smoke test of scripts/bench_tree.py (a benchmark prints numbers; this only checks it still runs
end to end and ends with its JSON summary line). Invariants: every figure it documents is
present (time per request and scheduler ops/s of both trees and their ratios, hit tokens per
tier, reload cost per policy), and both trees are credited the same operations: the scheduler's
eight per request and one per eviction, radix_ext's load-backs and re-matches not counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_tree.py"


def test_bench_tree_prints_its_figures_on_equal_counts():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--conversations", "40", "--repeats", "1",
         "--policy-donor-factors", "2"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    s = json.loads(out.strip().splitlines()[-1])
    n = s["requests"]
    for side in ("sglang", "radix_ext"):
        assert s["scheduler_ops"][side] == 8 * n + s["evictions"][side]
        assert s[f"{side}_us_per_request"] > 0 and s[f"{side}_scheduler_ops_per_s"] > 0
        # ops/s and time per request are two views of one timing
        seconds = s["scheduler_ops"][side] / s[f"{side}_scheduler_ops_per_s"]
        assert abs(seconds * 1e6 / n - s[f"{side}_us_per_request"]) <= 0.01 * (
            s[f"{side}_us_per_request"]) + 0.05
    assert s["radix_ext_hits"]["donor"] > 0 and s["radix_ext_uncounted"]["load_backs"] > 0
    assert abs(s["us_per_request_ratio"] - s["radix_ext_us_per_request"]
               / s["sglang_us_per_request"]) < 0.01 * s["us_per_request_ratio"] + 0.002
    assert "ratio" not in s  # the old figure that credited radix_ext's bookkeeping
    assert set(s["radix_ext_hits"]) == {"device", "donor", "miss"}
    assert set(s["reload_cost"]["donor_2x"]) == {"lru", "cost_aware"}
