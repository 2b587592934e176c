"""A mixture-of-experts model as a borrower on a SwiftCache node, served by SGLang's CPU engine:
`tiny-moe` (`MixtralForCausalLM`: `tiny`'s attention, 4 experts per layer, 2 routed per token;
`benchmarks/tools/tiny_model.py`). Its KV pool is an ordinary MHA pool; what differs from a
dense borrower is the forward its donor loads stream under (routed expert layers between the
attention layers that wait for each loaded layer).

Invariants, on real CPU servers: with a pool too small for five conversations, it keeps evicted
prefixes in a `tiny` donor's pages and loads them back (more cached tokens than stock SGLang
with the same pool), its greedy answers are stock SGLang's token for token (up to float
near-ties, `harness.same_greedy`), and they stay so after the donor's own burst took every page
back.
"""

from __future__ import annotations

import pytest
from integration.harness import metric, wait_for

pytestmark = pytest.mark.integration


def test_a_moe_borrower_keeps_prefixes_in_donor_pages_and_answers_like_stock(tmp_path):
    from integration.test_donation_e2e import (
        _cached,
        _check,
        _donor_burst,
        _lending_donor,
        _replay,
        _stock_replays,
        borrowing_server,
        replay_once_borrowing,
    )

    from benchmarks.tools.tiny_model import ensure_tiny_model
    from benchmarks.workloads.sharegpt import load_conversations

    moe, tiny = ensure_tiny_model(shape="moe"), ensure_tiny_model(shape="tiny")
    convs = load_conversations(5, min_turns=4, max_chars_per_message=200)
    ref, ref_tail = _stock_replays(moe, convs, tmp_path / "stock.log", 3, 4)
    rendezvous = str(tmp_path / "rv")
    donor = _lending_donor(tiny, rendezvous, tmp_path / "donor.log")
    borrower = borrowing_server(moe, rendezvous, tmp_path / "b.log")
    with donor, borrower:
        got = replay_once_borrowing(rendezvous, borrower, convs, ref)
        _check(got, ref)
        assert _cached(got) > _cached(ref), (_cached(got), _cached(ref))
        loaded = wait_for(lambda: metric(borrower, "swiftcache_loaded_tokens_total"), 30,
                          "prefixes loaded back from the donor's pages")
        _donor_burst(donor)  # the donor's own traffic takes every lent page back
        wait_for(lambda: "reclaimed" in borrower.log_text(), 30, "the borrower to see the reclaim")
        _check(_replay(borrower, convs, 4, forced=ref_tail), ref_tail)
        assert borrower.proc.poll() is None, borrower.log_tail()
    print(f"MoE borrower loaded {loaded} tokens back; cached {_cached(got)} against stock's "
          f"{_cached(ref)}")
