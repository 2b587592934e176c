"""SwiftCache together with HiCache's options: `--enable-swiftcache --enable-hierarchical-cache`
gives SwiftCache's tree a host tier on SGLang's own host KV pool (integration/host_tier.py).

Invariants, on real CPU servers with the same small device pool as the stock HiCache test:
- a multi-turn replay whose histories do not fit the device pool gives the greedy outputs of a
  stock server without HiCache, token for token (up to float near-ties, `harness.same_greedy`);
- prefixes really came back from the host tier (the server's own counters: host tokens stored
  and loaded > 0), so the outputs were computed from KV that went device -> host -> device
  through SGLang's host pool; with HiCache's default write policy (write_through) the host
  copies are made at insert and evictions copy nothing;
- a borrower's whole hierarchy (device, donor pages, host) through a full reclaim, under
  write_back (the donor tier is moved into host) and write_through (it is there already).
The option combinations refused at start-up are checked through SGLang's own argument parsing
in tests/unit/test_plugin.py.
"""

from __future__ import annotations

import pytest
from integration.harness import LocalServer, metric, wait_for
from integration.test_hicache_cpu import ARGS, POOL, check_same, replay

pytestmark = pytest.mark.integration


def test_write_through_copies_at_insert_and_serves_like_stock(tiny_model, tmp_path,
                                                              stock_servers):
    """HiCache's default policy: host copies made as the tree takes each prefix; evictions copy
    nothing; the outputs stay stock SGLang's."""
    args = ARGS + ["--enable-hierarchical-cache", "--hicache-ratio", "4",  # write_through
                   "--enable-metrics"]
    with LocalServer(tiny_model, max_total_tokens=POOL, extra_args=args,
                     log_path=tmp_path / "swift-wt.log") as server:
        got, _ = replay(server)
        wait_for(lambda: metric(server, "swiftcache_host_loaded_tokens_total"), 30,
                 "the host tier's counters on /metrics")
        stats = {k: metric(server, f"swiftcache_{k}_total")
                 for k in ("host_stored_tokens", "host_loaded_tokens", "stores_started")}
    want, _ = replay(stock_servers.get(tiny_model, POOL, ARGS))
    print(f"write_through: host stored {stats['host_stored_tokens']}, loaded "
          f"{stats['host_loaded_tokens']}, eviction stores {stats['stores_started']}")
    assert stats["host_stored_tokens"] > 0 and stats["host_loaded_tokens"] > 0
    assert stats["stores_started"] == 0  # every victim had its host copy already
    check_same(got, want, "SwiftCache with a write-through host tier against stock")


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_borrower_with_a_host_tier_keeps_what_a_reclaim_takes_back(tiny_model, tmp_path,
                                                                     policy, stock_servers):
    """The whole hierarchy: device, donor pages (while lent), host. A donor burst takes every
    lent page back; under write_back the borrower moves what it kept there into its host tier
    before it acknowledges, under write_through each of those prefixes has its host copy
    already; either way nothing is dropped, and replaying the conversations is served from
    host, token-identical to stock SGLang."""
    from integration.harness import metric, wait_for
    from integration.test_donation_e2e import (
        DONOR_POOL,
        SMALL_POOL,
        _args,
        _capacity,
        _check,
        _donor_burst,
        _replay,
        _stock_replays,
        borrowing_server,
        replay_once_borrowing,
    )

    from benchmarks.tools.local_server import starting
    from benchmarks.tools.tiny_model import ensure_tiny_model
    from benchmarks.workloads.sharegpt import load_conversations

    rendezvous = str(tmp_path / "rv")
    small_model = ensure_tiny_model(shape="small")
    convs = load_conversations(5, min_turns=4, max_chars_per_message=200)
    donor = LocalServer(tiny_model, max_total_tokens=DONOR_POOL, log_path=tmp_path / "donor.log",
                        extra_args=_args(rendezvous, "donor", "--swiftcache-lend-fraction", "0.5",
                                         "--swiftcache-reclaim-watermark", "0.5",
                                         "--swiftcache-relend-cooldown-s", "600",
                                         "--enable-metrics"))
    host = ["--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-write-policy",
            policy, "--hicache-mem-layout", "layer_first"]
    borrower = borrowing_server(small_model, rendezvous, tmp_path / "b.log", *host)
    with starting(donor, borrower) as ready:  # they start while stock answers
        ref, ref_tail = _stock_replays(stock_servers, small_model, convs, 3, 4)
        ready()
        got = replay_once_borrowing(rendezvous, borrower, convs, ref)
        _check(got, ref)
        wait_for(lambda: metric(borrower, "swiftcache_donor_tier_tokens"), 30,
                 "prefixes kept in the donor tier")
        in_donor = metric(borrower, "swiftcache_donor_tier_tokens")
        cap = wait_for(lambda: _capacity(rendezvous, "small-llama").get("host_capacity_tokens")
                       and _capacity(rendezvous, "small-llama"), 30,
                       "`ctl status` to show the borrower's tiers")
        assert cap["host_capacity_tokens"] >= 3 * SMALL_POOL  # --hicache-ratio 3
        assert cap["donor_tier_tokens"] > 0 and cap["donor_hit_tokens"] > 0
        host_hits = metric(borrower, "swiftcache_host_hit_tokens_total") or 0
        _donor_burst(donor)  # its own traffic takes every lent page back
        wait_for(lambda: metric(donor, "swiftcache_reclaim_latency_seconds_count") >= 1, 30,
                 "the donor to take its pages back")
        if policy == "write_back":  # the donor tier's prefixes had no host copy: moved there
            rescued = wait_for(lambda: metric(borrower, "swiftcache_rescued_tokens_total"), 30,
                               "the borrower to move the reclaimed prefixes into host memory")
        else:  # each had its host copy already: nothing to move
            wait_for(lambda: "reclaimed" in borrower.log_text(), 30, "the reclaim")
            rescued = metric(borrower, "swiftcache_rescued_tokens_total")
        assert (metric(borrower, "swiftcache_revoked_tokens_total") or 0) == 0
        got_tail = _replay(borrower, convs, 4, forced=ref_tail)
        _check(got_tail, ref_tail)
        wait_for(lambda: (metric(borrower, "swiftcache_host_hit_tokens_total") or 0) > host_hits,
                 30, "host hits after the reclaim")
        print(f"donor tier before the reclaim {in_donor} tokens; rescued {rescued}; host hits "
              f"{host_hits} -> {metric(borrower, 'swiftcache_host_hit_tokens_total')}")
        assert borrower.proc.poll() is None, borrower.log_tail()


def test_l3_below_the_host_tier_serves_after_a_flush_like_stock(tiny_model, tmp_path,
                                                                stock_servers):
    """`--hicache-storage-backend file` under SwiftCache's host tier: prefixes that reach host
    are written to the store, and after /flush_cache (device and host emptied; the store keeps
    its files) the same replay is fetched from L3 by the scheduler's prefetch and served with
    stock SGLang's outputs; SGLang's own `cached_tokens_details.storage` counts those tokens."""
    import json

    from integration.test_hicache_cpu import flush, total

    store = tmp_path / "l3"
    store.mkdir()
    extra = {"file_storage_path": str(store), "prefetch_threshold": 16}
    args = ARGS + ["--enable-hierarchical-cache", "--hicache-ratio", "2",
                   "--hicache-write-policy", "write_back", "--enable-metrics",
                   "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy",
                   "wait_complete", "--hicache-storage-backend-extra-config", json.dumps(extra)]
    with LocalServer(tiny_model, max_total_tokens=POOL, extra_args=args,
                     log_path=tmp_path / "swift-l3.log") as server:
        got, _ = replay(server)
        wait_for(lambda: metric(server, "swiftcache_l3_written_pages_total"), 30,
                 "pages written to L3")
        pages = list(store.rglob("*.bin"))
        flush(server)  # device and host tiers empty; L3 keeps its files
        again, details = replay(server)
        fetched = wait_for(lambda: metric(server, "swiftcache_l3_fetched_tokens_total"), 30,
                           "tokens fetched from L3")
        assert server.proc.poll() is None, server.log_tail()
    want, _ = replay(stock_servers.get(tiny_model, POOL, ARGS))
    print(f"L3: {len(pages)} files; after the flush {fetched} tokens fetched, storage hits "
          f"{total(details, 'storage')}, host {total(details, 'host')}")
    assert pages, f"nothing was written to {store}"
    assert total(details, "storage") > 0, "SGLang counted no storage hit after the flush"
    check_same(got, want, "SwiftCache with L3 against stock")
    check_same(again, want, "SwiftCache with L3 after flush (L3 hits) against stock")
