"""Two more model kinds on one SwiftCache node, served by SGLang's CPU engine: a hybrid
sliding-window donor, `tiny-swa` (`MellumForCausalLM`: full-attention and 64-token window layers
alternating, SGLang's `SWAKVPool` and `UnifiedRadixCache`), lending to a mixture-of-experts
borrower, `tiny-moe` (`MixtralForCausalLM`: `tiny`'s attention, 4 experts per layer, 2 routed
per token; both in `benchmarks/tools/tiny_model.py`).

Invariants, on real CPU servers:
- the donor lends idle pages of its full-attention pool; the borrower, with a pool too small
  for five conversations, keeps evicted prefixes there and loads them back under its forward
  (routed expert layers between the attention layers that wait for each loaded layer): more
  cached tokens than stock SGLang with the same pool, and answers that are stock's token for
  token (up to float near-ties, `harness.same_greedy`), also after the donor's own burst took
  every page back;
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
# pool lends the same bytes
DONOR_POOL = 8192


def _burst(server) -> list[dict]:
    """The donor's own traffic: concurrent prompts that need most of its free room."""
    from integration.test_donation_e2e import own_burst

    return own_burst(server, prompts=BURST, words=60, max_tokens=BURST_TOKENS)


def test_a_sliding_window_donor_lends_to_a_moe_borrower_and_both_serve_like_stock(
        tmp_path, stock_servers):
    from integration.test_donation_e2e import donor_kind_lends

    from benchmarks.tools.tiny_model import ensure_tiny_model

    run = donor_kind_lends(tmp_path, stock_servers, ensure_tiny_model(shape="swa"), _burst,
                           pool=DONOR_POOL, bursts=2, borrower_model=ensure_tiny_model(shape="moe"))
    assert run["cached"] > run["stock_cached"], run
    assert all(len(t) <= 1 for t in run["ties"]), f"the donor's answers differ: {run['ties']}"
