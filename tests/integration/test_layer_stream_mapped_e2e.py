"""Layer stream depth 0: the rows past a server's local ones mapped from another server's KV pool
under a lease and read in place, token-identical, through a reclaim and the donor's death.

Real SGLang CPU servers: stock SGLang on the small model with a pool large enough for everything
(the reference); a donor on the tiny model (4 layers, another shape) lending half of its pool; and
SwiftCache on the small model with --swiftcache-layer-stream donor --swiftcache-layer-stream-depth
0, a pool of STREAMED_POOL tokens of which a quarter is local (a stock LOCAL_POOL pool's memory).
Invariants:
- the server maps every piece of its pool past the local rows onto the donor's pages (its log
  says so) and the donor's metrics show them lent;
- a request whose context is 4x LOCAL_POOL, and a radix hit on it, are served with greedy outputs
  identical to the reference;
- a burst of the donor's own traffic, started once the server is prefilling another long request,
  reclaims the lent pages: the pieces move back to host memory and the output is still identical
  (nothing is aborted or recomputed);
- after the donor lends again and is then killed with SIGKILL, the server keeps serving
  identically, before and after it sees the lease lost, and the dead donor's pool is not left in
  /dev/shm.
"""

from __future__ import annotations

import os
import re
import threading

import pytest
from integration.harness import LocalServer, metric, wait_for
from integration.test_donation_e2e import _donor_burst, _pids_in
from integration.test_layer_stream_donor_e2e import DONOR_POOL, RECLAIM_TOKENS, _control
from integration.test_layer_stream_e2e import (
    COMMON,
    LOCAL_POOL,
    NEW_TOKENS,
    STREAMED_POOL,
    _generate,
    _prompt,
)

from benchmarks.layer_stream.context_servers import MAPPED_PLACED, wait_store_on_donor
from benchmarks.tools.local_server import serving
from benchmarks.tools.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.integration
LOCAL_FRACTION = 0.25  # 803 tokens, 200 of them local: rounded down to whole 4 KiB units, 200


def test_rows_read_in_place_from_a_donor_serve_four_times_the_local_pool_through_a_reclaim(
        tiny_model, tmp_path, stock_servers):
    model = ensure_tiny_model(shape="small")
    long_prompt = _prompt(4 * LOCAL_POOL - NEW_TOKENS)
    hit_prompt = long_prompt[:500] + _prompt(150, salt=1)
    during_reclaim = _prompt(700, salt=5)
    stock = stock_servers.get(model, 4096, COMMON)
    want = [_generate(stock, long_prompt), _generate(stock, hit_prompt),
            _generate(stock, during_reclaim, new=RECLAIM_TOKENS)]

    rendezvous = str(tmp_path / "rv")
    donor = LocalServer(tiny_model, max_total_tokens=DONOR_POOL, log_path=tmp_path / "donor.log",
                        extra_args=["--dtype", "float32", "--swiftcache-role", "donor",
                                    "--swiftcache-lend-fraction", "0.5",
                                    "--swiftcache-reclaim-watermark", "0.5", *_control(rendezvous)])
    mapped = LocalServer(model, max_total_tokens=STREAMED_POOL, log_path=tmp_path / "m.log",
                         extra_args=[*COMMON, "--swiftcache-layer-stream", "donor",
                                     "--swiftcache-layer-stream-depth", "0",
                                     "--swiftcache-layer-stream-resident-fraction",
                                     str(LOCAL_FRACTION), *_control(rendezvous)])
    with serving(donor, mapped):
        wait_store_on_donor(mapped, 180, pattern=MAPPED_PLACED)  # every piece on the donor
        assert metric(donor, "swiftcache_lent_tokens") > 0, "the donor's metrics show no lease"
        log = mapped.log_text()
        assert re.search(r"KV pool of 803 tokens read in place; 200 resident tokens local", log)
        got = [_generate(mapped, long_prompt), _generate(mapped, hit_prompt)]
        assert got == want[:2], "output read in place from donor pages differs from stock's"
        assert len(long_prompt) + len(got[0]) >= 4 * LOCAL_POOL

        start = len(mapped.log_text())
        result, log_at_end = [], []

        def serve() -> None:
            result.append(_generate(mapped, during_reclaim, new=RECLAIM_TOKENS))
            log_at_end.append(mapped.log_text())

        request = threading.Thread(target=serve)
        request.start()
        wait_for(lambda: "Prefill batch" in mapped.log_text()[start:], 120,
                 "the server to start prefilling the request")
        _donor_burst(donor)
        request.join(600)

        wait_for(lambda: "more pieces read in place" in mapped.log_text()[start:], 120,
                 "the donor to lend again after its cooldown and the pool to use it")
        os.killpg(donor.proc.pid, 9)
        donor.proc.wait(30)
        after_kill = _generate(mapped, hit_prompt)
        wait_for(lambda: "lost (" in mapped.log_text()[start:], 60,
                 "the server to see the donor's lease lost")
        after_loss = _generate(mapped, hit_prompt)
        assert mapped.proc.poll() is None, mapped.log_tail()
    assert result == [want[2]], "output during the donor's reclaim differs from stock SGLang's"
    assert "now read from host memory" in log_at_end[0][start:], \
        "the reclaim did not land while the request was being served"
    assert after_kill == want[1] and after_loss == want[1], "output after the donor died differs"
    leaked = [f for f in os.listdir("/dev/shm") if f.startswith("swift")
              and any(f"_p{pid}_" in f for pid in _pids_in(tmp_path / "donor.log"))]
    assert not leaked, f"the killed donor's pool left in /dev/shm: {leaked}"
