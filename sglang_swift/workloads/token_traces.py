"""Session traces for the simulator: token counts only, from real ShareGPT turns or seeded agents.

A session is a list of turns (new input tokens, output tokens, think time after the answer).
Token counts of ShareGPT messages are characters / 4 (params.CHARS_PER_TOKEN). Sessions end
before their context passes the model's window (Qwen3: 32,768 tokens natively, model card).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

CONTEXT_WINDOW = 32768  # Qwen3 model cards: 32,768 tokens natively (131,072 with YaRN)


@dataclass(frozen=True)
class SimTurn:
    new_tokens: int
    output_tokens: int
    think_s: float


@dataclass(frozen=True)
class SimSession:
    sid: int
    start: float
    turns: tuple[SimTurn, ...]
    shared_prefix_tokens: int = 0  # leading tokens shared with every session of `group`
    group: int = 0


@dataclass(frozen=True)
class ChatTraffic:
    rate: float  # sessions per second (Poisson)
    window_s: float  # sessions arrive during [0, window_s)
    think_mean_s: float = 10.0
    max_turns: int = 16
    offset: int = 0  # skip this many conversations (donors use others than the master)
    seed: int = 0


@dataclass(frozen=True)
class AgentTraffic:
    rate: float
    window_s: float
    system_min: int = 1500
    system_max: int = 3000
    steps_min: int = 8
    steps_max: int = 20
    tool_median: int = 600
    tool_sigma: float = 0.8
    tool_min: int = 100
    tool_max: int = 4000
    out_min: int = 16
    out_max: int = 128
    tool_latency_mean_s: float = 2.0
    seed: int = 0


_CONV_CACHE: dict[int, list] = {}


def _conversations(n: int):
    if n not in _CONV_CACHE:
        from sglang_swift.workloads.sharegpt import load_conversations

        _CONV_CACHE[n] = load_conversations(n, min_turns=1)
    return _CONV_CACHE[n]


def _arrivals(rng: random.Random, rate: float, window: float) -> list[float]:
    out, t = [], rng.expovariate(rate)
    while t < window:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _fit(turns: list[SimTurn], start_ctx: int = 0) -> tuple[SimTurn, ...]:
    ctx, out = start_ctx, []
    for t in turns:
        if ctx + t.new_tokens + t.output_tokens > CONTEXT_WINDOW:
            break
        out.append(t)
        ctx += t.new_tokens + t.output_tokens
    return tuple(out)


def chat_sessions(tr: ChatTraffic, sid_base: int = 0) -> list[SimSession]:
    rng = random.Random(tr.seed)
    starts = _arrivals(rng, tr.rate, tr.window_s)
    convs = _conversations(tr.offset + len(starts) + 1)
    out = []
    for i, st in enumerate(starts):
        c = convs[(tr.offset + i) % len(convs)]
        turns = [SimTurn(max(1, len(t.user) // 4), max(1, len(t.assistant) // 4),
                         rng.expovariate(1.0 / tr.think_mean_s)) for t in c.turns[: tr.max_turns]]
        turns = _fit(turns)
        if turns:
            out.append(SimSession(sid_base + i, st, turns))
    return out


def agent_sessions(tr: AgentTraffic, sid_base: int = 0) -> list[SimSession]:
    rng = random.Random(tr.seed + 17)
    system = rng.randint(tr.system_min, tr.system_max)  # one agent type: one shared system prompt
    out = []
    for i, st in enumerate(_arrivals(rng, tr.rate, tr.window_s)):
        n = rng.randint(tr.steps_min, tr.steps_max)
        turns = [SimTurn(system + 40, rng.randint(tr.out_min, tr.out_max), rng.expovariate(1 / tr.tool_latency_mean_s))]
        for _ in range(n - 1):
            size = int(min(tr.tool_max, max(tr.tool_min, rng.lognormvariate(math.log(tr.tool_median), tr.tool_sigma))))
            turns.append(SimTurn(size, rng.randint(tr.out_min, tr.out_max), rng.expovariate(1 / tr.tool_latency_mean_s)))
        turns = _fit(turns)
        if turns:
            out.append(SimSession(sid_base + i, st, turns, shared_prefix_tokens=system))
    return out


def page_ids(s: SimSession, upto_tokens: int, page: int) -> list[int]:
    """Radix keys of the first `upto_tokens // page` pages of session `s`'s token stream."""
    shared = s.shared_prefix_tokens // page
    n = upto_tokens // page
    base = (s.sid + 1) * 10_000_000
    gbase = -(s.group + 1) * 10_000_000
    return [gbase + p if p < shared else base + p for p in range(n)]
