"""bench_context's pieces that need no server: the sweep finds the exact limit and flags any
differing output, the forward trace is read incrementally, and the GPU estimate follows its
formula (streaming over NVLink costs less than over PCIe; it is never cheaper than resident)."""

from __future__ import annotations

import json
import urllib.error

import pytest

from sglang_swift.layer_stream import context_bench as cb
from sglang_swift.layer_stream import cost_model


@pytest.mark.parametrize("limit", [9, 10, 57, 300, 511])
def test_binary_search_finds_the_largest_served_context(limit):
    """With served(c) == (c <= limit), the search returns limit (lo - 1 when nothing is)."""
    calls = []

    def served(c):
        calls.append(c)
        return c <= limit

    assert cb.longest_served(served, 10, 512) == (limit if limit >= 10 else 9)
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
    reference = lambda c: [cb.prompt_ids(c - 4, c)[0]] * 4  # noqa: E731
    probe = cb.ContextProbe(FakeServer(100, wrong={60}), reference, 4)
    assert probe(50) and not probe(60) and not probe(102) and not probe(120)
    assert probe.verdicts == {50: "served", 60: "differs", 102: "truncated", 120: "refused"}
    assert not probe.identical
    clean = cb.ContextProbe(FakeServer(100), reference, 4)
    assert cb.longest_served(clean, 5, 200) == 100 and clean.identical


def test_forward_trace_is_read_from_where_the_last_read_stopped(tmp_path):
    """Records appended between two reads are returned once, in order."""
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"mode": "EXTEND"}) + "\n")
    first, offset = cb.read_trace(str(path), 0)
    with open(path, "a") as f:
        f.write(json.dumps({"mode": "DECODE"}) + "\n")
    second, _ = cb.read_trace(str(path), offset)
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
