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

import pytest

pytestmark = pytest.mark.integration

BURST = 3  # concurrent prompts of the donor's own, about 130 tokens each: they need more than
BURST_TOKENS = 8  # the free room it keeps (its lent pages come back); short, as the interpreted
DONOR_POOL = 1024  # Triton kernels run a long prefill slowly


def _burst(server) -> list[dict]:
    """The donor's own traffic: concurrent prompts that need most of its free room."""
    from integration.test_donation_e2e import own_burst

    return own_burst(server, prompts=BURST, words=40, max_tokens=BURST_TOKENS)


def test_an_mla_donor_lends_to_a_gqa_borrower_and_serves_like_stock(tmp_path, stock_servers):
    from integration.test_donation_e2e import donor_kind_lends

    from benchmarks.tools.tiny_model import MLA_SERVER_ARGS, ensure_tiny_model

    (ties,) = donor_kind_lends(tmp_path, stock_servers, ensure_tiny_model(shape="mla"), _burst,
                               pool=DONOR_POOL, server_args=MLA_SERVER_ARGS)["ties"]
    assert len(ties) <= 1, f"the MLA donor's own answers differ from stock's at {ties}"
