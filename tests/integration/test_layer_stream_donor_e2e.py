"""The layer stream cache streaming from a donor: a context 4x the local KV pool, its KV in another
server's KV pool under a lease, token-identical, through a reclaim.

Real SGLang CPU servers: stock SGLang on the small model with a pool large enough for everything
(the reference); a donor on the tiny model (4 layers, another shape) lending half of its pool; and
SwiftCache on the small model with --swiftcache-layer-stream donor, whose local KV memory is that
of a stock pool of LOCAL_POOL tokens (as in test_layer_stream_e2e). Invariants:
- the streaming server borrows the donor's pages for its whole store (its borrowed tokens reach
  the store's size) and the donor's own metrics show them lent;
- a request whose context is 4x LOCAL_POOL, and a radix hit on it, are served with greedy outputs
  identical to the reference, and the streamed reads came from the donor's memory;
- a burst of the donor's own traffic, started once the streaming server is prefilling another
  long request, reclaims the lent pages before that request finishes: the streaming server flips
  them to host memory and its output is still identical (nothing is aborted or recomputed: every
  row was written through to host memory);
- after the donor lends again and is then killed with SIGKILL, the streaming server keeps serving
  identically, before and after it sees the lease lost, and the dead donor's pool is not left in
  /dev/shm (the streaming server unlinks it once no lease of it is in its store).
"""

from __future__ import annotations

import os
import re
import threading

import pytest
from integration.harness import LocalServer, metric, wait_for
from integration.test_donation_e2e import _donor_burst, _pids_in
from integration.test_layer_stream_e2e import (
    COMMON,
    DEPTH,
    LOCAL_POOL,
    NEW_TOKENS,
    STREAMED_POOL,
    _generate,
    _prompt,
)

from benchmarks.layer_stream.context_servers import donor_reads
from benchmarks.tools.local_server import serving
from benchmarks.tools.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.integration
RECLAIM_TOKENS = 80
DONOR_POOL = 8192  # tiny pages of 2 KiB: lends 3584, the store needs 804 x 8 KiB / 2 KiB = 3216


def _control(rendezvous: str) -> list[str]:
    return ["--swiftcache-rendezvous-dir", rendezvous, "--enable-metrics",
            # a loaded 2-core CI machine can starve the agent thread for a second or more
            "--swiftcache-heartbeat-timeout-s", "3", "--swiftcache-heartbeat-interval-s", "0.3"]


def test_streaming_from_a_donor_serves_four_times_the_local_pool_through_a_reclaim(
        tiny_model, tmp_path, stock_servers):
    model = ensure_tiny_model(shape="small")
    long_prompt = _prompt(4 * LOCAL_POOL - NEW_TOKENS)  # context = 4 x LOCAL_POOL
    hit_prompt = long_prompt[:500] + _prompt(150, salt=1)
    during_reclaim = _prompt(700, salt=5)  # with RECLAIM_TOKENS: time for the reclaim to land
    stock = stock_servers.get(model, 4096, COMMON)
    want = [_generate(stock, long_prompt), _generate(stock, hit_prompt),
            _generate(stock, during_reclaim, new=RECLAIM_TOKENS)]

    rendezvous = str(tmp_path / "rv")
    donor = LocalServer(tiny_model, max_total_tokens=DONOR_POOL, log_path=tmp_path / "donor.log",
                        extra_args=["--dtype", "float32", "--swiftcache-role", "donor",
                                    "--swiftcache-lend-fraction", "0.5",
                                    "--swiftcache-reclaim-watermark", "0.5", *_control(rendezvous)])
    streamer = LocalServer(model, max_total_tokens=STREAMED_POOL, log_path=tmp_path / "s.log",
                           extra_args=[*COMMON, "--swiftcache-layer-stream", "donor",
                                       "--swiftcache-layer-stream-depth", str(DEPTH),
                                       "--swiftcache-layer-stream-resident-fraction", "0",
                                       *_control(rendezvous)])
    with serving(donor, streamer):
        wait_for(lambda: metric(streamer, "swiftcache_borrowed_tokens") >= STREAMED_POOL, 180,
                 "the streaming server to borrow donor pages for its whole store")
        lent = metric(donor, "swiftcache_lent_tokens")
        assert lent > 0, "the donor's metrics do not show the lease"
        got = [_generate(streamer, long_prompt), _generate(streamer, hit_prompt)]
        assert got == want[:2], "streamed-from-donor output differs from stock SGLang's"
        assert len(long_prompt) + len(got[0]) >= 4 * LOCAL_POOL
        wait_for(lambda: donor_reads(streamer.log_text()) > 0, 30,
                 "the streaming server's stats to show reads from donor memory")

        start = len(streamer.log_text())
        result, log_at_end = [], []

        def serve() -> None:
            result.append(_generate(streamer, during_reclaim, new=RECLAIM_TOKENS))
            log_at_end.append(streamer.log_text())

        request = threading.Thread(target=serve)
        request.start()
        wait_for(lambda: "Prefill batch" in streamer.log_text()[start:], 120,
                 "the streaming server to start prefilling the request")
        _donor_burst(donor)  # the donor's own traffic takes its pages back
        request.join(600)

        wait_for(lambda: "more store pages" in streamer.log_text()[start:], 120,
                 "the donor to lend again after its cooldown and the store to use it")
        os.killpg(donor.proc.pid, 9)  # SIGKILL the donor server, scheduler included
        donor.proc.wait(30)
        after_kill = _generate(streamer, hit_prompt)
        wait_for(lambda: "lost (" in streamer.log_text()[start:], 60,
                 "the streaming server to see the donor's lease lost")
        after_loss = _generate(streamer, hit_prompt)
        assert streamer.proc.poll() is None, streamer.log_tail()
        log = streamer.log_text()
    assert result == [want[2]], "output during the donor's reclaim differs from stock SGLang's"
    assert "now stream from host memory" in log_at_end[0][start:], \
        "the reclaim did not land while the request was being served"
    assert after_kill == want[1] and after_loss == want[1], "output after the donor died differs"
    assert re.search(r"local staging 2 of 8 layers .* every layer in donor memory under a lease",
                     log)
    leaked = [f for f in os.listdir("/dev/shm") if f.startswith("swift")
              and any(f"_p{pid}_" in f for pid in _pids_in(tmp_path / "donor.log"))]
    assert not leaked, f"the killed donor's pool left in /dev/shm: {leaked}"
