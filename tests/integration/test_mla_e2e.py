"""An MLA model on a SwiftCache node, served by SGLang's CPU engine: `tiny-mla`
(`DeepseekV2ForCausalLM`, one 576-wide latent row per token and layer; `benchmarks/tools/
tiny_model.py`), with `--attention-backend triton` under TRITON_INTERPRET=1 as that module says.

Invariants, on real CPU servers:
- an MLA donor lends idle pages of its own latent pool to a GQA borrower (`small`); the
  borrower's outputs are stock SGLang's, token for token (up to float near-ties,
  `harness.same_greedy`), while it keeps evicted prefixes in those pages and after the donor's
  own burst took every page back;
- the donor's own answers during that burst are those of a stock server of the same MLA model
  (lending did not touch the rows it serves from);
- (an MLA borrower, live: `test_l3_lending_e2e.py[mla-file]`, through a reclaim into its host
  tier and L3; `test_negative_control.py[mla]`, a wrong latent row in any layer caught.)
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from integration.harness import LocalServer, chat, metric, same_greedy, wait_for

pytestmark = pytest.mark.integration

BURST = 3  # concurrent prompts of the donor's own, about 130 tokens each: they need more than
BURST_TOKENS = 8  # the free room it keeps (its lent pages come back); short, as the interpreted
DONOR_POOL = 1024  # Triton kernels run a long prefill slowly


def _burst(server: LocalServer) -> list[dict]:
    """The donor's own traffic: concurrent prompts that need most of its free room."""
    prompts = [" ".join(f"item{i + 7 * j}" for i in range(40)) for j in range(BURST)]
    with cf.ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(lambda p: chat(server, [{"role": "user", "content": p}],
                                            BURST_TOKENS, top_logprobs=5), prompts))


def test_an_mla_donor_lends_to_a_gqa_borrower_and_serves_like_stock(tmp_path):
    from integration.test_donation_e2e import (
        SMALL_POOL,
        _args,
        _capacity,
        _check,
        _lending_donor,
        _replay,
        _stock_replays,
    )

    from benchmarks.tools.demo import wait_for_lease
    from benchmarks.tools.tiny_model import MLA_SERVER_ARGS, ensure_tiny_model
    from benchmarks.workloads.sharegpt import load_conversations

    mla, small = ensure_tiny_model(shape="mla"), ensure_tiny_model(shape="small")
    convs = load_conversations(5, min_turns=4, max_chars_per_message=200)
    ref, ref_tail = _stock_replays(small, convs, tmp_path / "stock.log", 3, 4)
    with LocalServer(mla, swiftcache=False, max_total_tokens=DONOR_POOL,
                     extra_args=["--enable-cache-report", "--dtype", "float32", *MLA_SERVER_ARGS],
                     log_path=tmp_path / "stock-mla.log") as stock_mla:
        ref_burst = _burst(stock_mla)

    rendezvous = str(tmp_path / "rv")
    donor = _lending_donor(mla, rendezvous, tmp_path / "donor.log", *MLA_SERVER_ARGS,
                           pool=DONOR_POOL)
    borrower = LocalServer(small, max_total_tokens=SMALL_POOL, log_path=tmp_path / "b.log",
                           extra_args=_args(rendezvous, "borrower", "--enable-metrics",
                                            "--swiftcache-max-borrow-blocks", "1500"))
    with donor, borrower:
        wait_for_lease(rendezvous, timeout_s=90)
        lent = wait_for(lambda: _capacity(rendezvous, "tiny-mla").get("lent_tokens"), 30,
                        "the MLA donor to report lent pages of its pool")
        wait_for(lambda: metric(borrower, "swiftcache_borrowed_tokens"), 30,
                 "the borrower to report the pages it borrowed")
        _check(_replay(borrower, convs, 3, forced=ref), ref)
        loaded = wait_for(lambda: metric(borrower, "swiftcache_loaded_tokens_total"), 30,
                          "prefixes loaded back from the MLA donor's pages")
        got_burst = _burst(donor)  # its own traffic takes every lent page back
        wait_for(lambda: metric(donor, "swiftcache_reclaim_latency_seconds_count") >= 1, 30,
                 "the donor to take its pages back")
        wait_for(lambda: "reclaimed" in borrower.log_text(), 30, "the borrower to see the reclaim")
        _check(_replay(borrower, convs, 4, forced=ref_tail), ref_tail)
        assert donor.proc.poll() is None and borrower.proc.poll() is None
    ties = same_greedy(got_burst, ref_burst)
    print(f"MLA donor lent {lent} tokens; borrower loaded {loaded} back; donor burst near-ties "
          f"{ties}")
    assert len(ties) <= 1, f"the MLA donor's own answers differ from stock's at {ties}"
