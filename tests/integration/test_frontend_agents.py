"""Agent programs written in SGLang's frontend language, against stock and SwiftCache servers (CPU).

Invariants: the same `sgl.function` agent (a fork per parallel tool call, a transcript that grows by
every tool result), run greedily through `sgl.RuntimeEndpoint`, gives identical outputs on a stock
SGLang server and on a SwiftCache server with the same weights; every program finishes; the
SwiftCache server serves the growing transcript from its prefix cache (cached tokens > 0).
"""

from __future__ import annotations

import time

import pytest
from integration.harness import LocalServer

from benchmarks.loadgen import frontend
from benchmarks.workloads.frontend_programs import agent_programs
from benchmarks.workloads.specs import AgentWorkload

pytestmark = pytest.mark.integration
AGENT = AgentWorkload(output_min=8, output_max=8, tool_latency_mean_s=0.0,
                      shared_system_prompt=False, seed=0, system_min=30, system_max=40,
                      steps_min=5, steps_max=5, tool_median=20, tool_min=10, tool_max=40)


def test_agent_programs_give_identical_greedy_outputs_on_stock_and_swiftcache(tiny_model, tmp_path,
                                                                            stock_servers):
    """Two agent programs (5 tool results, 2 parallel calls per step) run one after the other on
    each server: identical greedy outputs, all finished, transcript cache hits on SwiftCache."""
    programs = agent_programs(AGENT, 2, fanout=2)
    records, logs = {}, {}
    args = ["--enable-cache-report", "--dtype", "float32"]

    def run(label, server):
        backend = frontend.endpoint(server.base_url, chat_template="chatml")
        t0 = time.perf_counter()
        records[label] = [frontend.run_program(backend, p, label, t0) for p in programs]
        logs[label] = server.log_text()

    run("stock", stock_servers.get(tiny_model, 4096, args))  # one server at a time: 2 CPU cores
    with LocalServer(tiny_model, extra_args=[*args, "--swiftcache-role", "borrower"],
                     log_path=tmp_path / "swiftcache.log") as s:
        run("swiftcache", s)
    for label, recs in records.items():
        assert all(r.error is None for r in recs), [r.error for r in recs]
        assert all(set(r.outputs) == {"plan", "note0", "step0", "note1", "step1"}
                   for r in recs), label
    assert [r.outputs for r in records["stock"]] == [r.outputs for r in records["swiftcache"]]
    assert all(r.cached_tokens > 0 for r in records["swiftcache"])
    assert "Tree cache initialized: source=registered('swiftcache')" in logs["swiftcache"]
    assert "registered('swiftcache')" not in logs["stock"]
