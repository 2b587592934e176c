"""bench_tiers' plan and summary without servers: the upper bound (u) is stock SGLang with one
device pool holding the busy server's device pool, the lent tokens and the host tier; its ratios
are (s) / (u); SwiftCache above it is reported with its cause, never silently; outputs compare on
token ids, two empty answers never matching."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.loadgen.client import RequestRecord
from benchmarks.nodebench.plan import ModelFacts
from benchmarks.tiers import cli
from benchmarks.tiers.plan import RUNS, TierPlan, l3_args, servers

BUSY = ModelFacts("small", 8, 8192, 1, 1)
DONOR = ModelFacts("tiny", 4, 2048, 1, 1)


def test_the_upper_bound_is_one_stock_pool_of_device_lent_and_host_tokens():
    plan = TierPlan()  # busy 384, host 2x, donor 4096 lending half: 2048 x 2 KiB = 512 busy
    assert "u" in RUNS and "i" not in RUNS
    assert plan.bound_pool(BUSY, DONOR) == 384 + 512 + 769
    assert plan.bound_pool(BUSY, DONOR, host_measured=800) == 384 + 512 + 800
    spec = servers("u", plan, Path("b"), Path("d"), "rv", BUSY, DONOR)
    busy = spec["busy"]
    assert busy.pool == 384 + 512 + 769 and not busy.swiftcache
    assert not any(a.startswith("--hicache") or a == "--enable-hierarchical-cache"
                   for a in busy.args), busy.args
    assert spec["donor"].pool == 4096 - 2048
    # the pool every HiCache run gets is below the bound's
    h = servers("h", plan, Path("b"), Path("d"), "rv", BUSY, DONOR)["busy"]
    assert h.pool + plan.host_tokens() + plan.lent_busy_tokens(BUSY, DONOR) < busy.pool


def test_with_l3_the_bound_holds_every_history():
    plan = TierPlan(l3="file")
    assert plan.bound_pool(BUSY, DONOR, history_tokens=5000) == 5000 + 384
    assert plan.bound_pool(BUSY, DONOR, history_tokens=10) == 384 + 512 + 769


def test_each_run_starts_with_an_empty_l3_store(tmp_path):
    """Pages an earlier benchmark left in the store would be hits this run did not earn."""
    store = tmp_path / "l3-s"
    store.mkdir()
    (store / "left_by_an_earlier_run.bin").write_bytes(b"kv")
    args = l3_args(TierPlan(l3="file"), store)
    assert store.is_dir() and not any(store.iterdir())
    assert args[:2] == ("--hicache-storage-backend", "file") and str(store) in args[-1]
    assert l3_args(TierPlan(), store) == ()


def _rec(session, turn, ids, cached, ttft=0.1, prompt=50, completion=4):
    return RequestRecord(session=session, turn=turn, server="busy", t_send=0.0, ttft=ttft,
                         cached_tokens=cached, prompt_tokens=prompt,
                         completion_tokens=completion, output_ids=ids)


def _results(cached: dict, ids: dict | None = None) -> dict:
    """Two turns of one session per run; `cached[run]` = (turn 1, turn 2) cached tokens."""
    ids = ids or {}
    out = {}
    for run, (c1, c2) in cached.items():
        recs = [_rec("a", 1, ids.get(run, [1, 2]), c1, ttft=0.1 * (1 + len(out))),
                _rec("a", 2, [3, 4], c2, ttft=0.2 * (1 + len(out)))]
        out[run] = SimpleNamespace(records=recs, metrics={}, wall_s=1.0,
                                   loadavg=((0, 0, 0), (0, 0, 0)), pools={"busy": 1665},
                                   relent_before_resume=True)
    return out


def test_the_summary_ratios_are_swiftcache_over_the_upper_bound():
    res = _results({"r": (0, 0), "h": (0, 10), "s": (0, 30), "u": (0, 40), "t": (0, 10)})
    s = cli.summarize(TierPlan(turns=2), res, BUSY)
    assert s["cached_vs_upper_bound"] == pytest.approx(30 / 40)
    assert s["hicache_cached_vs_upper_bound"] == pytest.approx(10 / 40)
    assert s["upper_bound_exceeded"] is None
    p99 = s["ttft_p99_ms"]
    assert s["ttft_p99_vs_upper_bound"] == pytest.approx(p99["s"] / p99["u"])
    assert s["ttft_p99_upper_bound_vs_hicache"] == pytest.approx(p99["u"] / p99["h"])
    assert s["upper_bound_pool_tokens"] == 1665
    assert "cached_vs_ideal" not in s and s["identical"] is True


def test_swiftcache_above_the_upper_bound_is_reported_with_its_cause():
    res = _results({"r": (0, 0), "h": (0, 10), "s": (5, 50), "u": (5, 40), "t": (0, 10)})
    s = cli.summarize(TierPlan(turns=2), res, BUSY)
    assert s["cached_vs_upper_bound"] > 1
    over = s["upper_bound_exceeded"]
    assert over["by_tokens"] == 10 and over["turns"] == [2]
    assert "eviction order" in over["why"] and "bug" in over["why"]


def test_identity_is_on_token_ids_and_two_empty_answers_are_not_compared():
    runs = {"r": (0, 0), "h": (0, 0), "s": (0, 0), "u": (0, 0), "t": (0, 0)}
    s = cli.summarize(TierPlan(turns=2), _results(runs, {"s": [1, 9]}), BUSY)
    assert s["identical"] is False and s["mismatches"]["s"] == 1
    empty = cli.summarize(TierPlan(turns=2), _results(runs, {"r": [], "s": []}), BUSY)
    assert empty["empty_in_both"]["s"] == 1 and empty["empty_in_both"]["h"] == 0
    assert empty["mismatches"]["s"] == 0 and empty["compared"]["s"] == 1  # the other turn
    assert empty["identical"] is True and empty["mismatches"]["h"] == 1  # h answered, r not
    one_sided = cli.summarize(TierPlan(turns=2), _results(runs, {"s": []}), BUSY)
    assert one_sided["identical"] is False and one_sided["mismatches"]["s"] == 1


def test_nothing_compared_is_not_identical():
    runs = {"r": (0, 0), "h": (0, 0), "s": (0, 0), "u": (0, 0), "t": (0, 0)}
    res = _results(runs)
    for run in res.values():
        for r in run.records:
            r.output_ids = []  # every request refused by every server
    none = cli.summarize(TierPlan(turns=2), res, BUSY)
    assert none["compared"]["s"] == 0 and none["identical"] is False
