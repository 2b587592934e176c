"""Smoke test of scripts/bench_tree.py (a benchmark prints numbers; this only checks it still runs
end to end and ends with its JSON summary line). Invariant: every figure it documents is
present: ops/s of both trees, their ratio, hit tokens per tier, reload cost per policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_tree.py"


def test_bench_tree_prints_its_figures():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--conversations", "40", "--repeats", "1",
         "--policy-donor-factors", "2"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ratio"] > 0 and summary["sglang_ops_per_s"] > 0
    assert set(summary["radix_ext_hits"]) == {"device", "donor", "miss"}
    assert set(summary["reload_cost"]["donor_2x"]) == {"lru", "cost_aware"}
