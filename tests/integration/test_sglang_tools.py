"""SGLang's own benchmark tools, run unchanged against a SwiftCache server (CPU, tiny model)."""

from __future__ import annotations

import os

import pytest
from integration.harness import LocalServer

from benchmarks.loadgen import sglang_tools

pytestmark = pytest.mark.integration
# path of SGLang's benchmark/hicache/bench_multiturn.py
BENCH_MULTITURN = os.environ.get("SGLANG_BENCH_MULTITURN")


def test_bench_multiturn_imports_are_all_in_the_installed_sglang():
    """Every name benchmark/hicache/bench_multiturn.py imports from sglang exists in the pinned
    wheel, so the script runs as it is once copied from SGLang's repository."""
    assert sglang_tools.missing_multiturn_imports() == []


def test_serving_benchmark_completes_single_and_multi_turn_traffic_on_swiftcache(tiny_model,
                                                                                  tmp_path):
    """`python -m sglang.benchmark.serving` completes every request against a SwiftCache server: 8
    random-id requests (/generate), and every turn of its generated-shared-prefix multi-turn chat
    (2 groups x 2 conversations x 3 turns, /v1/chat/completions)."""
    model = str(tiny_model)
    with LocalServer(tiny_model, swiftcache=True, extra_args=["--enable-cache-report"],
                     log_path=tmp_path / "server.log") as s:
        single = sglang_tools.serving_benchmark(s.base_url, model, tmp_path / "single.jsonl",
                                                dataset="random-ids", num_prompts=8)
        multi = sglang_tools.serving_benchmark(s.base_url, model, tmp_path / "multi.jsonl",
                                               dataset="generated-shared-prefix", num_prompts=4,
                                               groups=2, turns=3)
        log = s.log_text()
    assert "Tree cache initialized: source=registered('swiftcache')" in log
    assert single["completed"] == 8 and single["backend"] == "sglang" and single["p99_ttft_ms"] > 0
    assert multi["completed"] == 4 * 3 and multi["dataset_name"] == "generated-shared-prefix"


@pytest.mark.skipif(not BENCH_MULTITURN,
                    reason="set SGLANG_BENCH_MULTITURN to the path of SGLang's "
                           "benchmark/hicache/bench_multiturn.py (it is not in the wheel)")
def test_bench_multiturn_completes_against_swiftcache(tiny_model, tmp_path):
    """SGLang's multi-turn benchmark, on random token ids at one rate, exits cleanly against a
    SwiftCache server and writes its result record."""
    with LocalServer(tiny_model, swiftcache=True, extra_args=["--enable-cache-report"]) as s:
        record = sglang_tools.multiturn_benchmark(BENCH_MULTITURN, s.base_url, str(tiny_model),
                                                  tmp_path / "multiturn.jsonl", clients=3, rounds=3)
    assert record  # multiturn_benchmark raised if the script failed or wrote nothing
