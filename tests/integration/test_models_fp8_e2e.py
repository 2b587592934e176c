"""fp8 KV in live servers: a donor and a borrower both on `--kv-cache-dtype fp8_e4m3`.

Real SGLang CPU servers, as in test_donation_e2e (a tiny-model donor, a small-model borrower
whose pool is too small for the conversations), every one of them with fp8 KV: SGLang stores it
as uint8 and the donor lends those bytes. The reference is stock SGLang on the small model with
the same fp8 pool. Invariants:
- the borrower takes a lease of the fp8 donor's own pool;
- its greedy outputs equal stock SGLang's with fp8 KV, turn by turn (`same_greedy`), with more
  cached tokens than stock: prefixes came back from the donor's fp8 pages;
- a burst of the donor's own traffic takes every lent page back, and the borrower stays
  token-identical afterwards.
On a CPU without Intel AMX, stock SGLang 0.5.23 does not start with fp8 KV ("ValueError: CPU
FP8 KV cache requires Intel AMX support.", kv_cache_configurator.py), nor with fp8_e5m2 on any
CPU ("--kv-cache-dtype fp8_e5m2 is not supported on CPU."): the test is then skipped with
SGLang's error (it has not run on this project's CI machine, which has no AMX); the data plane's
fp8 handling is tested without servers in tests/unit/test_models_fp8.py.
"""

from __future__ import annotations

import pytest
from integration.harness import LocalServer, metric, wait_for
from integration.test_donation_e2e import (
    DONOR_POOL,
    SMALL_POOL,
    _args,
    _cached,
    _check,
    _donor_burst,
    _replay,
    borrowing_server,
    replay_once_borrowing,
)

from benchmarks.tools.local_server import ServerStartError, serving
from benchmarks.tools.tiny_model import ensure_tiny_model
from benchmarks.workloads.sharegpt import load_conversations

pytestmark = pytest.mark.integration
FP8 = ["--kv-cache-dtype", "fp8_e4m3"]
NO_CPU_FP8 = "CPU FP8 KV cache requires Intel AMX support"  # SGLang 0.5.23's own refusal


def test_fp8_borrower_and_fp8_donor_are_token_identical_to_stock_fp8(tiny_model, tmp_path):
    rendezvous = str(tmp_path / "rv")
    small_model = ensure_tiny_model(shape="small")
    convs = load_conversations(4, min_turns=4, max_chars_per_message=200)
    stock = LocalServer(small_model, swiftcache=False, max_total_tokens=SMALL_POOL,
                        extra_args=["--enable-cache-report", "--dtype", "float32", *FP8],
                        log_path=tmp_path / "stock.log")
    try:
        stock.start()
    except ServerStartError:
        if NO_CPU_FP8 in stock.log_text():
            pytest.skip(f"stock SGLang does not serve fp8 KV on this CPU: {NO_CPU_FP8}")
        raise
    try:
        ref = _replay(stock, convs, 3)
        ref_tail = _replay(stock, convs[:2], 4)
    finally:
        stock.stop()
    donor = LocalServer(tiny_model, max_total_tokens=DONOR_POOL, log_path=tmp_path / "donor.log",
                        extra_args=_args(rendezvous, "donor", "--swiftcache-lend-fraction", "0.5",
                                         "--swiftcache-reclaim-watermark", "0.5",
                                         "--swiftcache-relend-cooldown-s", "600",
                                         "--enable-metrics", *FP8))
    borrower = borrowing_server(small_model, rendezvous, tmp_path / "b.log", *FP8)
    with serving(donor, borrower):
        assert "placed in shared" in donor.log_text(), donor.log_tail()
        got = replay_once_borrowing(rendezvous, borrower, convs, ref)
        _check(got, ref)
        assert _cached(got) > _cached(ref), (_cached(got), _cached(ref))
        assert metric(borrower, "swiftcache_loaded_tokens_total") > 0
        _donor_burst(donor)
        wait_for(lambda: metric(donor, "swiftcache_reclaim_latency_seconds_count") >= 1, 30,
                 "the donor's fp8 pages to come back into its pool")
        _check(_replay(borrower, convs[:2], 4, forced=ref_tail), ref_tail)
        assert borrower.proc.poll() is None and donor.proc.poll() is None
