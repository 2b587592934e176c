"""Token-count traces for the simulator, rendered from a ChatWorkload or AgentWorkload (specs.py).

A session is a start time and a list of turns (new input tokens, output tokens, wait after the
answer). Start times come from a stream of their own and the turns from the workload's seed, as
text_sessions draws them: session i has the same turns at every arrival rate (only its start time
scales with the rate), so a sweep over rates compares like with like. Sessions end before their
context passes the model's window (Qwen3: 32,768 tokens natively, model card).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .specs import AgentWorkload, Arrivals, ChatWorkload, DrawnTurn

CONTEXT_WINDOW = 32768  # Qwen3 model cards: 32,768 tokens natively (131,072 with YaRN)


@dataclass(frozen=True)
class TokenTurn:
    new_tokens: int
    output_tokens: int
    think_s: float


@dataclass(frozen=True)
class TokenSession:
    sid: int
    start: float
    turns: tuple[TokenTurn, ...]
    shared_prefix_tokens: int = 0  # leading tokens shared with every session of `group`
    group: int = 0


def _fit(turns: list[TokenTurn]) -> tuple[TokenTurn, ...]:
    """The turns that fit in CONTEXT_WINDOW, in order (the session ends before the first that does
    not)."""
    ctx, out = 0, []
    for t in turns:
        if ctx + t.new_tokens + t.output_tokens > CONTEXT_WINDOW:
            break
        out.append(t)
        ctx += t.new_tokens + t.output_tokens
    return tuple(out)


def _turn(d: DrawnTurn, extra_new_tokens: int = 0) -> TokenTurn:
    return TokenTurn(d.size + extra_new_tokens, d.output_tokens, d.think_s)


def _start_times(seed: int, arrivals: Arrivals) -> list[float]:
    # a stream apart from the turns': at rate r the k-th start is the rate-1 k-th start / r
    return arrivals.start_times(random.Random(f"session-starts:{seed}"))


def chat_traces(w: ChatWorkload, arrivals: Arrivals, sid_base: int = 0) -> list[TokenSession]:
    """One session per arrival, replaying ShareGPT conversations; empty sessions are dropped."""
    rng = random.Random(w.seed)
    starts = _start_times(w.seed, arrivals)
    out = []
    for i, (st, conv) in enumerate(zip(starts, w.conversations(len(starts)))):
        turns = _fit([_turn(d) for d in w.draw_turns(conv, rng)])
        if turns:
            out.append(TokenSession(sid_base + i, st, turns))
    return out


def agent_traces(w: AgentWorkload, arrivals: Arrivals, sid_base: int = 0) -> list[TokenSession]:
    """One tool loop per arrival; the system prompt's tokens come with the first turn, and where it
    is shared they are every session's shared prefix."""
    rng = random.Random(w.seed)
    shared = w.draw_system_size(rng) if w.shared_system_prompt else 0
    out = []
    for i, st in enumerate(_start_times(w.seed, arrivals)):
        system = shared if w.shared_system_prompt else w.draw_system_size(rng)
        drawn = w.draw_turns(rng)
        turns = _fit([_turn(d, system if k == 0 else 0) for k, d in enumerate(drawn)])
        if turns:
            out.append(TokenSession(sid_base + i, st, turns, shared_prefix_tokens=shared))
    return out


def page_ids(s: TokenSession, upto_tokens: int, page: int) -> list[int]:
    """Radix keys of the first `upto_tokens // page` pages of session `s`'s token stream."""
    shared = s.shared_prefix_tokens // page
    n = upto_tokens // page
    base = (s.sid + 1) * 10_000_000
    gbase = -(s.group + 1) * 10_000_000
    return [gbase + p if p < shared else base + p for p in range(n)]
