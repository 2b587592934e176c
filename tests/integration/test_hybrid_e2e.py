"""A hybrid sliding-window model on a SwiftCache node, served by SGLang's CPU engine:
`tiny-swa` (`MellumForCausalLM`: full-attention and 64-token window layers alternating, SGLang's
`SWAKVPool` and `UnifiedRadixCache`; `benchmarks/tools/tiny_model.py`), as a donor.

Invariants, on real CPU servers:
- it lends idle pages of its full-attention pool to a GQA borrower (`small`), whose outputs are
  stock SGLang's token for token (up to float near-ties, `harness.same_greedy`) while it keeps
  evicted prefixes in those pages, and after the donor's own burst took every page back;
- the donor's own answers, in the burst that takes its pages back and in one after it, are
  those of a stock server of the same model: its window pool, its tree and its requests' rows
  are SGLang's, untouched by lending (prompts longer than the window; its full-attention and
  window free lists hand out different ids while pages are lent, which SGLang's CPU backend
  reads right only with `cpu_compat/window_reads.py`);
- its idle memory check holds throughout: lent pages count as in use in the full-attention
  pool (the server would log a leak and stop otherwise).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

BURST = 3  # concurrent prompts of the donor's own, about 200 tokens each (past the 64-token
BURST_TOKENS = 16  # window): more than its headroom above the reserve, so lent pages come back
# its full-attention page is 1 KiB a token (2 layers), half of `tiny`'s: twice test_donation's
# pool lends the same bytes (about 500 of the borrower's tokens)
DONOR_POOL = 8192


def _burst(server) -> list[dict]:
    """The donor's own traffic: concurrent prompts that need most of its free room."""
    from integration.test_donation_e2e import own_burst

    return own_burst(server, prompts=BURST, words=60, max_tokens=BURST_TOKENS)


def test_a_sliding_window_donor_lends_to_a_gqa_borrower_and_serves_like_stock(tmp_path):
    from integration.test_donation_e2e import donor_kind_lends_to_small

    from benchmarks.tools.tiny_model import ensure_tiny_model

    ties = donor_kind_lends_to_small(tmp_path, ensure_tiny_model(shape="swa"), _burst,
                                     pool=DONOR_POOL, bursts=2)
    assert all(len(t) <= 1 for t in ties), f"the donor's own answers differ from stock's: {ties}"
