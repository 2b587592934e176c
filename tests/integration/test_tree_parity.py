"""Parity: with no donor and no host tier, the `swiftcache` backend (radix_ext behind SGLang's
prefix-cache interface) behaves exactly like stock SGLang.

Invariant: replaying the same real ShareGPT multi-turn conversations (interleaved, greedy) through
a real CPU server with --enable-swiftcache and through a stock one gives identical outputs and
identical `cached_tokens` on every turn; and the swiftcache server really ran radix_ext.
"""

from __future__ import annotations

import pytest
from integration.harness import LocalServer, chat

from benchmarks.workloads.sharegpt import load_conversations

pytestmark = pytest.mark.integration
MAX_TOKENS = 12
TURNS = 4


ARGS = ["--enable-cache-report", "--dtype", "float32"]


def replay(server, conversations: int, chars: int) -> tuple[list[str], list[int]]:
    """Turn-by-turn replay, conversations interleaved so they share and evict each other's KV."""
    convs = load_conversations(conversations, min_turns=TURNS, max_chars_per_message=chars)
    history: list[list[dict]] = [[] for _ in convs]
    outputs, cached = [], []
    for t in range(TURNS):
        for conv, messages in zip(convs, history):
            messages.append({"role": "user", "content": conv.turns[t].user})
            resp = chat(server, messages, MAX_TOKENS)
            text = resp["choices"][0]["message"]["content"]
            details = resp["usage"].get("prompt_tokens_details") or {}
            outputs.append(text)
            cached.append(details.get("cached_tokens", 0))
            messages.append({"role": "assistant", "content": text})
    return outputs, cached


# (KV pool tokens, conversations, chars per message): a pool that holds everything; and one
# smaller than the three conversations' histories, so both trees must evict the same prefixes.
@pytest.mark.parametrize("pool,conversations,chars", [(4096, 2, 300), (512, 3, 150)],
                         ids=["roomy", "evicting"])
def test_swiftcache_tree_matches_stock_sglang(tiny_model, tmp_path, stock_servers, pool,
                                              conversations, chars):
    with LocalServer(tiny_model, extra_args=ARGS, log_path=tmp_path / "swift.log",
                     max_total_tokens=pool) as swift:
        swift_out, swift_cached = replay(swift, conversations, chars)
        swift_log = swift.log_text()
    # a fresh stock server, or a shared one with its cache flushed (conftest.StockServers)
    stock_out, stock_cached = replay(stock_servers.get(tiny_model, pool, ARGS), conversations,
                                     chars)
    print(f"cached tokens per turn: swiftcache {swift_cached}, stock {stock_cached}")
    assert "SwiftCache: radix_ext tree" in swift_log
    assert swift_out == stock_out
    assert swift_cached == stock_cached, f"swiftcache {swift_cached} vs stock {stock_cached}"
    assert sum(swift_cached) > 0, "the replay never reused a prefix; the test proves nothing"
