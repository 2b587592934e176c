"""bench_context's pieces that need no server: the sweep finds the exact limit and flags any
differing output, the forward trace is read incrementally, and the GPU estimate follows its
formula (streaming over NVLink costs less than over PCIe; it is never cheaper than resident)."""

from __future__ import annotations

import json
import urllib.error

import pytest

from benchmarks.layer_stream import context_bench as cb
from benchmarks.layer_stream import context_resident as cr
from benchmarks.layer_stream import context_servers as cs
from benchmarks.layer_stream import cost_model


@pytest.mark.parametrize("limit", [9, 10, 57, 300, 511])
def test_binary_search_finds_the_largest_served_context(limit):
    """With served(c) == (c <= limit), the search returns limit (lo - 1 when nothing is)."""
    calls = []

    def served(c):
        calls.append(c)
        return c <= limit

    assert cs.longest_served(served, 10, 512) == (limit if limit >= 10 else 9)
    assert len(calls) <= 11


class FakeServer:
    """Serves contexts up to `limit` (refuses prompts past it, truncates outputs at it), and
    answers differently from the reference for the contexts in `wrong`."""

    def __init__(self, limit, wrong=()):
        self.limit, self.wrong = limit, set(wrong)

    def post(self, path, payload, timeout):
        ids, new = payload["input_ids"], payload["sampling_params"]["max_new_tokens"]
        if len(ids) >= self.limit:
            raise urllib.error.HTTPError("u", 400, "too long", {}, None)
        n = min(new, self.limit - len(ids))
        ctx = len(ids) + new
        return {"output_ids": [ids[0] + (ctx in self.wrong)] * n}


def test_probe_tells_refused_truncated_differs_and_served_apart():
    """Each verdict is recorded; only a full-length output unequal to the reference's makes the
    run not identical."""
    reference = lambda c: [cs.prompt_ids(c - 4, c)[0]] * 4  # noqa: E731
    probe = cs.ContextProbe(FakeServer(100, wrong={60}), reference, 4)
    assert probe(50) and not probe(60) and not probe(102) and not probe(120)
    assert probe.verdicts == {50: "served", 60: "differs", 102: "truncated", 120: "refused"}
    assert not probe.identical
    clean = cs.ContextProbe(FakeServer(100), reference, 4)
    assert cs.longest_served(clean, 5, 200) == 100 and clean.identical


def test_forward_trace_is_read_from_where_the_last_read_stopped(tmp_path):
    """Records appended between two reads are returned once, in order."""
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"mode": "EXTEND"}) + "\n")
    first, offset = cs.read_trace(str(path), 0)
    with open(path, "a") as f:
        f.write(json.dumps({"mode": "DECODE"}) + "\n")
    second, _ = cs.read_trace(str(path), offset)
    assert [r["mode"] for r in first] == ["EXTEND"] and [r["mode"] for r in second] == ["DECODE"]


def test_gpu_estimate_follows_the_bandwidths():
    """A streamed step is never cheaper than resident; over a slower link it costs more; at the
    same context the H200 (faster HBM and NVLink) pays less than the H20."""
    rows = {(r["gpu"], r["link"]): r for r in cost_model.expected_costs()}
    for r in rows.values():
        assert r["decode_step_ratio"] >= 1.0 and r["prefill_token_ratio"] >= 1.0
    nv, pcie = "donor HBM over NVLink", "host memory over PCIe"
    for gpu in ("H20", "H200"):
        assert rows[(gpu, pcie)]["decode_step_ratio"] > rows[(gpu, nv)]["decode_step_ratio"]
    assert rows[("H200", nv)]["decode_step_ratio"] < rows[("H20", nv)]["decode_step_ratio"]
    d = cost_model.decode_step_ratio("H200", "Qwen3-32B", 32768, pcie)
    kv = 32768 * 2 * 64 * 8 * 128 * 2
    assert d["streamed_ms"] == pytest.approx(kv / 55.6e9 * 1e3)
    assert set(cost_model.sources()) >= {"H20.pcie_bw_dir", "H200.nvlink_bw_dir", "Qwen3-32B"}


QUICK = cb.Setup(pool=128, layers=8, depth=2, out_tokens=8, chunk=256, decode_steps=16,
                 repeats=3)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_resident_plan_is_the_largest_pool_within_the_stock_memory(fraction):
    """The planned pool's local rows (L R + D (mapped - R), as the pool rounds R and the rows)
    are at most the stock pool's L (P + 1), no larger pool up to the unrounded estimate fits,
    and it is near (f + (1 - f) L/D) (P + 1) - 1 tokens."""
    budget = QUICK.layers * (QUICK.pool + 1)
    plan = cr.ResidentPlan.fit(QUICK, fraction, 512)
    assert 0 < plan.resident < plan.tokens and plan.local_rows <= budget
    estimate = int((fraction + (1 - fraction) * 4) * (QUICK.pool + 1)) - 1
    for tokens in range(plan.tokens + 1, estimate + 1):
        assert cr.ResidentPlan.of(QUICK, fraction, tokens, 512).local_rows > budget
    assert plan.tokens >= 0.9 * estimate


def test_resident_plan_rounds_as_the_pool_does():
    """A 500-token pool at f = 0.5 on 512-byte rows: 100 resident tokens before rounding, 96 in
    whole 4 KiB units (what the live e2e test's server logs), 1584 local rows (1.5 MiB)."""
    plan = cr.ResidentPlan.of(QUICK, 0.5, 500, 512)
    assert (plan.resident, plan.local_rows) == (96, 8 * 96 + 2 * (504 - 96))
    assert cr.short_prompt_len(plan.resident, 16) == 48
    assert cr.short_prompt_len(30, 16) == 12  # the output must fit in the resident slots too


def test_resident_tokens_are_read_from_the_pool_line():
    log = ("... SwiftCache layer streaming: KV pool of 319 tokens; local staging 2 of 8 layers "
           "(1.0 MiB), every layer in host memory (2.5 MiB); 56 resident tokens (every layer's "
           "rows local, in the MiB before, never streamed)\n")
    assert cs.logged_resident_tokens(log) == 56
    assert cs.streamed_pool_log(log)["tokens"] == 319
    with pytest.raises(RuntimeError):
        cs.logged_resident_tokens("no pool line")


class TracedServer:
    """Appends one extend and `new - 1` decode forwards to its trace for each request, each
    copying `rows` rows; records the calls to `prepare` between requests."""

    def __init__(self, trace, rows):
        self.trace, self.rows, self.events = trace, rows, []

    def post(self, path, payload, timeout):
        ids, new = payload["input_ids"], payload["sampling_params"]["max_new_tokens"]
        self.events.append("generate")
        forwards = [("EXTEND", len(ids))] + [("DECODE", 1)] * (new - 1)
        with open(self.trace, "a") as f:
            for mode, n in forwards:
                f.write(json.dumps({"mode": mode, "bs": 1, "new_tokens": n, "cpu_ms": 2.0 * n,
                                    "wall_ms": 3.0 * n, "copy_ms": 0.0, "rows_loaded": self.rows,
                                    "rows_saved": 1 if self.rows else 0}) + "\n")
        return {"output_ids": [0] * new}


def test_rows_copied_come_from_the_streamed_trace_after_each_prepare(tmp_path):
    """Rows copied per request are the streamed server's loaded + written-through rows of that
    request's forwards (the largest over repeats); `prepare` runs before every request."""
    traces = {name: str(tmp_path / f"{name}.jsonl") for name in ("streamed", "resident")}
    servers = {"streamed": TracedServer(traces["streamed"], rows=5),
               "resident": TracedServer(traces["resident"], rows=0)}
    costs, rows = cb.measure_with_rows(servers, traces, 10, QUICK,
                                       prepare=lambda s: s.events.append("prepare"))
    assert rows == {"rows_copied_per_request": 17 * 6, "rows_loaded_per_decode_step": 5}
    assert servers["streamed"].events == ["prepare", "generate"] * QUICK.repeats
    assert costs["decode_step_ratio"] == 1.0 and costs["prefill_ms_per_token_streamed"] == 2.0
    assert costs == cb.measure_costs(servers, traces, 10, QUICK)
