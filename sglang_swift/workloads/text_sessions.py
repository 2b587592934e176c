"""Sessions to replay: real ShareGPT conversations (chat) or seeded synthetic tool loops (agent).

A session is a list of steps. Each step appends `user` text to the context, asks for at most
`max_tokens`, and after the answer arrives waits `think_s` before the next step. Nothing here does
I/O except reading the ShareGPT file through `sglang_swift.workloads.sharegpt`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    user: str
    max_tokens: int
    think_s: float  # wait after this step's answer, before the next step


@dataclass(frozen=True)
class Session:
    id: str
    system: str
    steps: tuple[Step, ...]
    role: str = "user"  # "tool" for agent tool results after the first step


@dataclass(frozen=True)
class ChatSpec:
    """Chat sessions from ShareGPT. Think time is exponential with mean `think_mean_s`."""

    num_sessions: int = 32
    max_turns: int = 8
    min_turns: int = 2
    max_chars: int = 2000
    max_tokens: int = 128
    think_mean_s: float = 2.0
    seed: int = 0


@dataclass(frozen=True)
class AgentSpec:
    """Tool-use loops: one long system prompt, then steps of a short model turn and a tool result.

    system prompt words ~ Uniform[system_min, system_max]; steps ~ Uniform[steps_min, steps_max];
    tool result words ~ LogNormal(ln(tool_median), tool_sigma) clipped to [tool_min, tool_max];
    model output <= max_tokens; tool latency ~ Exponential(mean tool_latency_s).
    """

    num_sessions: int = 8
    system_min: int = 1500
    system_max: int = 3000
    steps_min: int = 8
    steps_max: int = 20
    tool_median: int = 600
    tool_sigma: float = 0.8
    tool_min: int = 100
    tool_max: int = 4000
    max_tokens: int = 48
    tool_latency_s: float = 0.5
    seed: int = 0


def _exp(rng: random.Random, mean: float) -> float:
    return rng.expovariate(1.0 / mean) if mean > 0 else 0.0


def _clip_tokens_from_chars(text: str) -> int:
    return max(1, len(text) // 4)  # ~4 chars per token (OpenAI guidance)


def chat_sessions(spec: ChatSpec) -> list[Session]:
    from sglang_swift.workloads.sharegpt import load_conversations

    rng = random.Random(spec.seed)
    convs = load_conversations(spec.num_sessions, min_turns=spec.min_turns,
                               max_chars_per_message=spec.max_chars)
    out = []
    for c in convs:
        steps = []
        for t in c.turns[: spec.max_turns]:
            # output budget follows the recorded answer's length, capped: real answer-length mix
            steps.append(Step(t.user, min(spec.max_tokens, _clip_tokens_from_chars(t.assistant)),
                              _exp(rng, spec.think_mean_s)))
        out.append(Session(f"sharegpt-{c.id}", "", tuple(steps)))
    return out


_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "den", "par", "qu", "ix", "om", "el")


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))


def agent_sessions(spec: AgentSpec) -> list[Session]:
    rng = random.Random(spec.seed)
    out = []
    for i in range(spec.num_sessions):
        system = "You are a tool-using agent. Tools: " + _words(rng, rng.randint(spec.system_min, spec.system_max))
        n = rng.randint(spec.steps_min, spec.steps_max)
        steps = [Step("Task: " + _words(rng, 40), spec.max_tokens, _exp(rng, spec.tool_latency_s))]
        for _ in range(n - 1):
            size = int(min(spec.tool_max, max(spec.tool_min, rng.lognormvariate(
                math.log(spec.tool_median), spec.tool_sigma))))
            steps.append(Step("Tool result: " + _words(rng, size), spec.max_tokens,
                              _exp(rng, spec.tool_latency_s)))
        out.append(Session(f"agent-{spec.seed}-{i}", system, tuple(steps), role="tool"))
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Start offsets (s) of `n` sessions arriving as a Poisson process of `rate` sessions/s."""
    rng = random.Random(seed * 7919 + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return out
