"""The benchmarks' instruments attach through the product's one debug seam, only when asked.

Invariants: with no observer installed the seam's forward hook calls the forward as it is; the
forward trace writes one JSON line per forward, streamed or not, with the fields the benchmarks
read (mode, size, wall and thread CPU time, the streamed pool's copies, minor faults, slot runs),
and its wall time includes the layer stream's per-forward bracket; `instruments_env` asks for
nothing unless given a trace, and a bad SWIFTCACHE_INSTRUMENTS fails with the fix."""

from __future__ import annotations

import json
import types

import pytest
import torch

from benchmarks.instruments import INSTALL, instruments_env, traces
from sglang_swift.integration import debug_seam
from sglang_swift.layer_stream import hooks


@pytest.fixture
def seam():
    debug_seam.reset()
    yield debug_seam.OBSERVERS
    debug_seam.reset()


def _forward(runner, batch, fn=lambda r, fb: "out"):
    """The hook chain the plugin registers when a server streams and is traced: the seam's
    forward hook outside the layer stream's."""
    return debug_seam.around_forward(
        lambda r, fb: hooks.around_model_forward(fn, r, fb), runner, batch)


def test_without_an_observer_the_forward_runs_as_it_is(seam):
    assert not seam.any()
    assert debug_seam.around_forward(lambda r, fb: (r, fb), "runner", "fb") == ("runner", "fb")


def test_forward_trace_records_every_forward_streamed_or_not(tmp_path, seam):
    """With a trace file set, each forward appends one JSON line with its mode, size, times and
    (for a streamed pool) the copy time spent inside it; a stock server's forward is traced too."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    path = tmp_path / "trace.jsonl"
    traces.install(seam, {traces.FORWARD_TRACE_ENV: str(path)})
    stats = {"copy_s": 1.0, "rows_loaded": 10, "rows_saved": 3}
    pool = types.SimpleNamespace(begin_layer_stream=lambda fb, r2t: None,
                                 end_layer_stream=lambda: stats.update(copy_s=1.25, rows_loaded=17,
                                                                       rows_saved=5),
                                 stream_stats=lambda: stats)
    batch = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=2,
                                  out_cache_loc=torch.tensor([3, 4]),
                                  seq_lens_cpu=torch.tensor([10, 20]))
    r2t = types.SimpleNamespace(req_to_token=None)
    streamed = types.SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=r2t)
    stock = types.SimpleNamespace(token_to_kv_pool=object(), req_to_token_pool=r2t)
    for runner in (streamed, stock):
        assert _forward(runner, batch) == "out"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["mode"], r["bs"], r["new_tokens"], r["seq_tokens"], r["streamed"]) for r in lines] \
        == [("DECODE", 2, 2, 30, True), ("DECODE", 2, 2, 30, False)]
    assert lines[0]["copy_ms"] == pytest.approx(250.0) and lines[1]["copy_ms"] == 0.0
    assert (lines[0]["rows_loaded"], lines[0]["rows_saved"]) == (7, 2)
    assert (lines[1]["rows_loaded"], lines[1]["rows_saved"]) == (0, 0)
    assert all(r["wall_ms"] >= 0 and r["cpu_ms"] >= 0 for r in lines)
    assert [r["slot_runs"] for r in lines] == [1, 1]  # slots 3, 4: one run


def touch_fresh_memory(runner, fb):
    import mmap
    with mmap.mmap(-1, 64 * 4096) as m:  # anonymous: each page faults on its first write
        for i in range(0, len(m), 4096):
            m[i] = 1


def test_forward_trace_counts_slot_runs_and_the_threads_page_faults(tmp_path, seam):
    """`slot_runs`: in how many runs of consecutive slots the new tokens' KV went; and the
    forward thread's minor page faults: a forward that touches fresh memory shows them."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    path = tmp_path / "trace.jsonl"
    traces.install(seam, {traces.FORWARD_TRACE_ENV: str(path)})
    batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=1,
                                  out_cache_loc=torch.tensor([5, 6, 7, 20, 21, 9]),
                                  seq_lens_cpu=torch.tensor([6]))
    stock = types.SimpleNamespace(token_to_kv_pool=object(),
                                  req_to_token_pool=types.SimpleNamespace(req_to_token=None))
    _forward(stock, batch, touch_fresh_memory)
    _forward(stock, batch, lambda r, fb: None)
    touched, idle = [json.loads(x) for x in path.read_text().splitlines()]
    assert touched["slot_runs"] == idle["slot_runs"] == 3  # 5-7, 20-21, 9
    assert touched["minor_faults"] >= 64 > idle["minor_faults"]


def test_load_trace_and_reclaim_split_are_installed_from_the_environment(tmp_path, seam):
    path = tmp_path / "loads.jsonl"
    traces.install(seam, {traces.LOAD_TRACE_ENV: str(path), traces.RECLAIM_SPLIT_ENV: "1"})
    assert seam.forward is None
    seam.batch_load({"tokens": 3, "ok": True})
    assert json.loads(path.read_text()) == {"tokens": 3, "ok": True}
    assert "on a CPU" in seam.reclaim_fence()()


def test_instruments_env_asks_only_for_what_is_given(tmp_path, seam):
    base = {"PYTHONPATH": "/elsewhere"}
    assert instruments_env(base) == base
    env = instruments_env(base, forward_trace=str(tmp_path / "f.jsonl"))
    assert env[debug_seam.INSTRUMENTS_ENV] == INSTALL
    assert env[traces.FORWARD_TRACE_ENV] == str(tmp_path / "f.jsonl")
    assert env["PYTHONPATH"].endswith("/elsewhere") and traces.LOAD_TRACE_ENV not in env
    assert debug_seam.install_from_env(env) == INSTALL and seam.forward is not None


def test_an_unimportable_instrument_fails_with_the_fix(seam):
    with pytest.raises(debug_seam.InstrumentsUnavailable, match="PYTHONPATH"):
        debug_seam.install_from_env({debug_seam.INSTRUMENTS_ENV: "no_such_module:install"})
    assert debug_seam.install_from_env({}) is None and not seam.any()


def test_step_trace_writes_one_line_per_iteration_that_ran_a_forward(tmp_path, seam):
    """The step point with the forward point: an iteration's line comes when the next begins,
    carries its forwards' time inside its own, and idle iterations (no forward) write none;
    the plugin registers the step mark only where a step observer is installed."""
    from sglang_swift.integration import plugin

    path = tmp_path / "steps.jsonl"
    traces.install(seam, {traces.STEP_TRACE_ENV: str(path)})
    assert [p.attr for p, _ in plugin.server_hooks(None, seam)] == ["ingest_requests",
                                                                      "forward"]
    for forwards in (2, 0, 1):
        debug_seam.before_step(None)
        for _ in range(forwards):
            debug_seam.around_forward(lambda r, fb: None, None, None)
    debug_seam.before_step(None)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["forwards"] for r in rows] == [2, 1]
    assert all(0 <= r["forward_ms"] <= r["step_ms"] for r in rows)
    debug_seam.reset()
    assert plugin.server_hooks(None, debug_seam.OBSERVERS) == []
