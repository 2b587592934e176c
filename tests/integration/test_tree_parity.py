"""Parity: with no donor and no host tier, the `swiftcache` backend (radix_ext behind SGLang's
prefix-cache interface) behaves exactly like stock SGLang.

Invariant: replaying the same real ShareGPT multi-turn conversations (interleaved, greedy) through
a real CPU server with --enable-swiftcache and through a stock one gives identical outputs and
identical `cached_tokens` on every turn; and the swiftcache server really ran radix_ext.
"""

from __future__ import annotations

import pytest

from integration.harness import LocalServer, chat
from sglang_swift.workloads.sharegpt import load_conversations

pytestmark = pytest.mark.integration
MAX_TOKENS = 12
TURNS = 4


def replay(model_dir, swiftcache: bool, log_path, max_total_tokens: int, conversations: int,
           chars: int) -> tuple[list[str], list[int], str]:
    """Turn-by-turn replay, conversations interleaved so they share and evict each other's KV."""
    convs = load_conversations(conversations, min_turns=TURNS, max_chars_per_message=chars)
    history: list[list[dict]] = [[] for _ in convs]
    outputs, cached = [], []
    args = ["--enable-cache-report", "--dtype", "float32"]
    with LocalServer(model_dir, swiftcache=swiftcache, extra_args=args, log_path=log_path,
                     max_total_tokens=max_total_tokens) as s:
        for t in range(TURNS):
            for conv, messages in zip(convs, history):
                messages.append({"role": "user", "content": conv.turns[t].user})
                resp = chat(s, messages, MAX_TOKENS)
                text = resp["choices"][0]["message"]["content"]
                details = resp["usage"].get("prompt_tokens_details") or {}
                outputs.append(text)
                cached.append(details.get("cached_tokens", 0))
                messages.append({"role": "assistant", "content": text})
        log = s.log_text()
    return outputs, cached, log


# (KV pool tokens, conversations, chars per message): a pool that holds everything; and one
# smaller than the three conversations' histories, so both trees must evict the same prefixes.
@pytest.mark.parametrize("pool,conversations,chars", [(4096, 2, 300), (512, 3, 150)],
                         ids=["roomy", "evicting"])
def test_swiftcache_tree_matches_stock_sglang(tiny_model, tmp_path, pool, conversations, chars):
    swift_out, swift_cached, swift_log = replay(tiny_model, True, tmp_path / "swift.log",
                                                pool, conversations, chars)
    stock_out, stock_cached, _ = replay(tiny_model, False, tmp_path / "stock.log",
                                        pool, conversations, chars)
    print(f"cached tokens per turn: swiftcache {swift_cached}, stock {stock_cached}")
    assert "SwiftCache: radix_ext tree" in swift_log
    assert swift_out == stock_out
    assert swift_cached == stock_cached, f"swiftcache {swift_cached} vs stock {stock_cached}"
    assert sum(swift_cached) > 0, "the replay never reused a prefix; the test proves nothing"
