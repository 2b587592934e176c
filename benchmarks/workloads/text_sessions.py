"""Text sessions for the load generator, rendered from a ChatWorkload or AgentWorkload (specs.py).

A session is a list of turns. Each turn appends `user` text to the context, asks for `max_tokens`
(the server is told to ignore EOS, so that is the answer's length), and after the answer arrives
waits `think_s` before the next turn. Nothing here does I/O except reading ShareGPT (chat).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .specs import AgentWorkload, Arrivals, ChatWorkload


@dataclass(frozen=True)
class TextTurn:
    user: str
    max_tokens: int
    think_s: float  # wait after this turn's answer, before the next turn


@dataclass(frozen=True)
class TextSession:
    id: str
    system: str
    turns: tuple[TextTurn, ...]
    role: str = "user"  # who speaks after the first turn: "tool" for agent tool results


def chat_sessions(w: ChatWorkload, count: int) -> list[TextSession]:
    """`count` sessions replaying ShareGPT conversations (fewer turns where a conversation has
    fewer)."""
    rng = random.Random(w.seed)
    out = []
    for c in w.conversations(count):
        turns = tuple(TextTurn(d.text, d.output_tokens, d.think_s) for d in w.draw_turns(c, rng))
        out.append(TextSession(f"sharegpt-{c.id}", "", turns))
    return out


_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "den", "par", "qu", "ix", "om", "el")


def _words(rng: random.Random, n: int) -> str:
    """`n` made-up words: text no two sessions share by chance, so only real prefixes hit a
    cache."""
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
                    for _ in range(n))


def _system_prompt(w: AgentWorkload, rng: random.Random) -> str:
    return "You are a tool-using agent. Tools: " + _words(rng, w.draw_system_size(rng))


def agent_sessions(w: AgentWorkload, count: int) -> list[TextSession]:
    """`count` tool loops; sizes are counts of filler words."""
    rng = random.Random(w.seed)
    shared = _system_prompt(w, rng) if w.shared_system_prompt else None
    out = []
    for i in range(count):
        system = shared if shared is not None else _system_prompt(w, rng)
        drawn = w.draw_turns(rng, fill=_words)
        turns = tuple(TextTurn(("Task: " if k == 0 else "Tool result: ") + d.text, d.output_tokens,
                               d.think_s) for k, d in enumerate(drawn))
        out.append(TextSession(f"agent-{w.seed}-{i}", system, turns, role="tool"))
    return out


def start_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Start offsets (s) of `count` sessions arriving at `rate` sessions/s, the first at 0.

    Drawn from their own stream, apart from the sessions' content, so the same sessions can be
    replayed at several rates.
    """
    return Arrivals(rate=rate, count=count).start_times(random.Random(seed * 7919 + 1))
