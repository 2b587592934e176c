"""End to end: the real SGLang server with --enable-swiftcache, on CPU, against HF transformers.

Invariants: a 4-turn chat through /v1/chat/completions gives, turn by turn, exactly the greedy
output of HF transformers on the same weights; turns 2-4 reuse the previous turns' KV (cached
tokens > 0); the parsed SwiftCache config reached the scheduler process.
"""

from __future__ import annotations

import functools

import pytest
from integration.harness import LocalServer, chat

from benchmarks.workloads.sharegpt import load_conversations

pytestmark = pytest.mark.integration
MAX_TOKENS = 12
TURNS = 4


@functools.lru_cache(maxsize=1)
def _hf(model_dir):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok, LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def hf_greedy(model_dir, messages: list[dict], max_new_tokens: int) -> str:
    """The reference: HF transformers' greedy generate on the same weights, in float32."""
    import torch

    tok, model = _hf(model_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_four_turn_chat_matches_hf_and_reuses_prefix(tiny_model, tmp_path):
    conv = load_conversations(1, min_turns=TURNS, max_chars_per_message=300)[0]
    messages: list[dict] = []
    cached, outputs, expected = [], [], []
    args = ["--enable-cache-report", "--dtype", "float32", "--swiftcache-role", "borrower"]
    with LocalServer(tiny_model, swiftcache=True, extra_args=args,
                     log_path=tmp_path / "server.log") as server:
        for turn in conv.turns[:TURNS]:
            messages.append({"role": "user", "content": turn.user})
            resp = chat(server, messages, MAX_TOKENS)
            text = resp["choices"][0]["message"]["content"]
            details = resp["usage"].get("prompt_tokens_details") or {}
            cached.append(details.get("cached_tokens", 0))
            outputs.append(text)
            expected.append(hf_greedy(tiny_model, messages, MAX_TOKENS))
            messages.append({"role": "assistant", "content": text})
        log = server.log_text()
    assert outputs == expected
    assert all(c > 0 for c in cached[1:]), f"cached tokens per turn: {cached}"
    assert "Tree cache initialized: source=registered('swiftcache')" in log
    # the config as parsed in the launcher, seen by the scheduler
    assert '"role": "borrower"' in log
