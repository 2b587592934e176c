"""SwiftCache together with HiCache's options: `--enable-swiftcache --enable-hierarchical-cache`
gives SwiftCache's tree a host tier on SGLang's own host KV pool (integration/host_tier.py).

Invariants, on real CPU servers with the same small device pool as the stock HiCache test:
- a multi-turn replay whose histories do not fit the device pool gives the greedy outputs of a
  stock server without HiCache, token for token (up to float near-ties, `harness.same_greedy`);
- prefixes really came back from the host tier (the server's own counters: host tokens stored
  and loaded > 0), so the outputs were computed from KV that went device -> host -> device
  through SGLang's host pool;
- HiCache's default write policy (write_through) is refused at start-up with the option named.
"""

from __future__ import annotations

import re
import time

import pytest
from integration.harness import LocalServer, ServerStartError
from integration.test_hicache_cpu import ARGS, POOL, ask, check_same, replay, total

from sglang_swift.integration.cache import REPORT_INTERVAL_S

pytestmark = pytest.mark.integration

HOST_TIER = ["--enable-hierarchical-cache", "--hicache-ratio", "4",
             "--hicache-write-policy", "write_back"]


def last_stats(log: str) -> dict:
    """The last counters the tree logged (`SwiftCache stats: {...}`)."""
    found = re.findall(r"SwiftCache stats: (\{[^}]*\})", log)
    assert found, "the server never logged its SwiftCache counters"
    return {k: float(v) for k, v in re.findall(r"'(\w+)': ([0-9.e+-]+)", found[-1])}


def test_swiftcache_with_a_host_tier_serves_like_stock(tiny_model, tmp_path, stock_servers):
    with LocalServer(tiny_model, max_total_tokens=POOL, extra_args=ARGS + HOST_TIER,
                     log_path=tmp_path / "swift-host.log") as server:
        got, details = replay(server)
        time.sleep(REPORT_INTERVAL_S + 0.5)  # the counters are logged at most this often
        ask(server, [{"role": "user", "content": "hi"}])  # a loop iteration that logs them
        log = server.log_text()
    want, _ = replay(stock_servers.get(tiny_model, POOL, ARGS))
    stats = last_stats(log)
    print(f"host tier: stored {stats.get('host_stored_tokens')}, loaded "
          f"{stats.get('host_loaded_tokens')}; SGLang's details host {total(details, 'host')}, "
          f"device {total(details, 'device')}")
    assert "SwiftCache host tier: MHATokenToKVPoolHost" in log
    assert stats["host_stored_tokens"] > 0 and stats["host_loaded_tokens"] > 0, \
        "no prefix came back from the host tier: proves nothing"
    assert stats["loads_failed"] == 0
    check_same(got, want, "SwiftCache with a host tier against stock")


def test_write_through_is_refused_with_the_option_named(tiny_model, tmp_path):
    args = ARGS + ["--enable-hierarchical-cache", "--hicache-ratio", "4"]
    server = LocalServer(tiny_model, max_total_tokens=POOL, extra_args=args,
                         log_path=tmp_path / "refused.log")
    with pytest.raises(ServerStartError):
        server.start()
    server.stop()
    assert "--hicache-write-policy write_through" in server.log_text()
