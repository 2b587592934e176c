"""The chaos run's traffic: which requests, in which order, and stock SGLang's answers to them.

Conversations are replayed in groups: within a group round-robin, turn by turn (so each history
is evicted from the borrower's small pool before its next turn, and comes back from donor
memory), one group after the other (so a long soak needs more conversations, never longer ones:
every history stays within the pool). Each request's history carries stock's answers to the
earlier turns, so the borrower is sent exactly the requests stock was sent, and one wrong answer
does not change the requests after it.
"""

from __future__ import annotations

import math
import urllib.error
from pathlib import Path

from ..workloads.sharegpt import Conversation, load_conversations

Key = tuple[int, int]  # (conversation index, turn)
TEMPLATE_MARGIN = 32  # tokens for the chat template's markers around answers we do not know yet


def pick_conversations(n: int, turns: int, max_chars: int, budget_tokens: int,
                       tokenizer_dir: Path, max_tokens: int) -> list[Conversation]:
    """The first `n` ShareGPT conversations (file order) whose `turns`-turn history, with
    `max_tokens` per answer, fits `budget_tokens` (the borrower's pool)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    picked: list[Conversation] = []
    pool = load_conversations(4 * n + 16, min_turns=turns, max_chars_per_message=max_chars)
    for conv in pool:
        msgs = [m for t in conv.turns[:turns] for m in ({"role": "user", "content": t.user},
                                                        {"role": "assistant", "content": ""})]
        ids = tok.apply_chat_template(msgs[:-1], tokenize=True, add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        if len(ids) + turns * max_tokens + TEMPLATE_MARGIN <= budget_tokens:
            picked.append(conv)
        if len(picked) == n:
            return picked
    raise ValueError(f"only {len(picked)} of the first {len(pool)} conversations fit a "
                     f"{budget_tokens}-token pool in {turns} turns of <= {max_chars} characters; "
                     "use fewer turns, shorter messages or a bigger pool")


class Replay:
    """The requests in order and, once stock answered them, the reference answers."""

    def __init__(self, convs: list[Conversation], *, group: int, turns: int,
                 max_tokens: int) -> None:
        self.convs, self.max_tokens = convs, max_tokens
        self.keys: list[Key] = [
            (c, t) for g in range(0, len(convs), group) for t in range(turns)
            for c in range(g, min(g + group, len(convs)))]
        self.reference: dict[Key, str] = {}

    @staticmethod
    def groups_for(requests: int, group: int, turns: int) -> int:
        return math.ceil(requests / (group * turns))

    def messages(self, key: Key) -> list[dict]:
        conv, turn = key
        msgs: list[dict] = []
        for t in range(turn + 1):
            msgs.append({"role": "user", "content": self.convs[conv].turns[t].user})
            if t < turn:
                msgs.append({"role": "assistant", "content": self.reference[(conv, t)]})
        return msgs

    def payload(self, key: Key) -> dict:
        return {"model": "chaos", "messages": self.messages(key), "max_tokens": self.max_tokens,
                "temperature": 0.0}


LOAD_FAILED = "SwiftCache: loading the cached prefix from a donor failed"  # streaming.py's 503


def ask(server, payload: dict, timeout_s: float) -> tuple[str, str]:
    """("ok", text), ("error", why) or ("hang", why): one greedy chat request, bounded; or
    ("load_failed", why): SwiftCache answered 503 because the request's donor load failed
    (the server asks the client to retry: its prefix is recomputed or loaded again)."""
    try:
        resp = server.post("/v1/chat/completions", payload, timeout=timeout_s)
        return "ok", resp["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as exc:
        body = exc.read()[:1000].decode(errors="replace")
        kind = "load_failed" if exc.code == 503 and LOAD_FAILED in body else "error"
        return kind, f"HTTP {exc.code}: {body[:300]!r}"
    except (TimeoutError, OSError) as exc:  # URLError is an OSError; a read timeout is too
        reason = getattr(exc, "reason", exc)
        kind = "hang" if "timed out" in str(reason) else "error"
        return kind, f"{type(exc).__name__}: {reason}"
