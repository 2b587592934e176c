"""Chat and agent traffic, described once for the load generator and the simulator.

A workload holds distributions and a seed. Two renderers turn it into sessions:
  text_sessions.py  prompts and output budgets, replayed against real servers (benchmarks/loadgen)
  token_traces.py   token counts with start times, run by the node simulator (benchmarks/simulator)
The draws are made here, so both renderers sample the same distributions in the same order; they
differ only in what they make of a draw (text, or a token count) and in how their sessions start.

Sizes of agent prompts (system prompt, task, tool results) are counts of filler words in text
sessions and counts of tokens in token traces: the same numbers, two units (a filler word is 1-2
tokens). Chat sizes come from real ShareGPT messages, in characters / CHARS_PER_TOKEN.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

from .sharegpt import Conversation

CHARS_PER_TOKEN = 4  # OpenAI tokenizer guidance: ~4 characters per English token


def tokens_in(text: str) -> int:
    """Token count of `text` estimated as characters / CHARS_PER_TOKEN, at least 1."""
    return max(1, len(text) // CHARS_PER_TOKEN)


def exponential(rng: random.Random, mean: float) -> float:
    """Exponential(mean) draw; a mean of 0 means no wait and draws nothing."""
    return rng.expovariate(1.0 / mean) if mean > 0 else 0.0


@dataclass(frozen=True)
class Arrivals:
    """Session starts: a Poisson process of `rate` sessions per second, bounded one of two ways.

    count:    exactly `count` sessions; the first starts at 0 (a benchmark run should not open
              idle).
    window_s: every arrival in [0, window_s), the first one gap after 0; how many is random.
    """

    rate: float
    count: int | None = None
    window_s: float | None = None

    def __post_init__(self) -> None:
        if (self.count is None) == (self.window_s is None):
            raise ValueError("Arrivals needs exactly one bound: count=N sessions or "
                             "window_s=seconds")
        if self.rate < 0 or (self.window_s is not None and self.rate <= 0):
            raise ValueError(f"rate must be > 0 for a window (>= 0 for a count), got {self.rate}")

    def start_times(self, rng: random.Random) -> list[float]:
        """Start times in seconds, ascending. A count at rate 0 starts every session at 0."""
        if self.count is not None:
            out, t = [], 0.0
            for _ in range(self.count):
                out.append(t)
                t += rng.expovariate(self.rate) if self.rate > 0 else 0.0
            return out
        out, t = [], rng.expovariate(self.rate)
        while t < self.window_s:
            out.append(t)
            t += rng.expovariate(self.rate)
        return out


@dataclass(frozen=True)
class DrawnTurn:
    """One turn as a workload drew it, before a renderer makes it text or token counts.

    size: new prompt tokens (chat) or filler words / tokens (agent: the task, then tool results).
    text: the new prompt text where there is one (chat: the user message; agent: the filler that
    `fill` made), else "". output_tokens: tokens the answer has. think_s: wait after the answer.
    """

    size: int
    text: str
    output_tokens: int
    think_s: float


_conversation_prefix: dict[tuple[int, int | None], tuple[int, list[Conversation]]] = {}


def _first_conversations(limit: int, min_turns: int, max_chars: int | None) -> list[Conversation]:
    # The simulator asks for many prefixes of the same file order; load the largest once.
    key = (min_turns, max_chars)
    loaded = _conversation_prefix.get(key)
    if loaded is None or loaded[0] < limit:
        from .sharegpt import load_conversations

        loaded = (limit, load_conversations(limit, min_turns=min_turns,
                                            max_chars_per_message=max_chars))
        _conversation_prefix[key] = loaded
    return loaded[1][:limit]


@dataclass(frozen=True, kw_only=True)
class ChatWorkload:
    """Chat: ShareGPT conversations in file order, each recorded user message one turn.

    Turns per session <= max_turns (conversations with fewer than min_turns are skipped); think
    time after each answer ~ Exponential(mean think_mean_s); the answer's length is the recorded
    answer's tokens, capped at max_output_tokens where given. Messages are clipped to
    max_chars_per_message characters where given (tiny CPU models need short prompts).
    """

    max_turns: int
    think_mean_s: float
    min_turns: int = 1
    max_chars_per_message: int | None = None
    max_output_tokens: int | None = None
    # skip this many conversations (a donor replays others than the master)
    conversation_offset: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.min_turns < 1 or self.max_turns < 1:
            raise ValueError(f"min_turns and max_turns must be >= 1, "
                             f"got {self.min_turns} and {self.max_turns}")

    def conversations(self, count: int) -> list[Conversation]:
        """`count` conversations from conversation_offset on, in file order (wrapping round the file
        where it holds fewer)."""
        if count <= 0:
            return []
        convs = _first_conversations(self.conversation_offset + count, self.min_turns,
                                     self.max_chars_per_message)
        return [convs[(self.conversation_offset + i) % len(convs)] for i in range(count)]

    def draw_turns(self, conv: Conversation, rng: random.Random) -> list[DrawnTurn]:
        """The first max_turns turns of `conv`; one think-time draw per turn."""
        out = []
        for t in conv.turns[: self.max_turns]:
            answer = tokens_in(t.assistant)
            if self.max_output_tokens is not None:
                answer = min(self.max_output_tokens, answer)
            out.append(DrawnTurn(tokens_in(t.user), t.user, answer,
                                 exponential(rng, self.think_mean_s)))
        return out


@dataclass(frozen=True, kw_only=True)
class AgentWorkload:
    """Tool-use loops: a long system prompt, a task, then tool results, each answered by a short
    turn.

    system prompt ~ Uniform[system_min, system_max], one for all sessions if shared_system_prompt
    (one agent type) else one per session; task = task_size; steps ~ Uniform[steps_min, steps_max];
    tool result ~ LogNormal(ln tool_median, tool_sigma) clipped to [tool_min, tool_max];
    output ~ Uniform[output_min, output_max]; tool latency ~ Exponential(mean tool_latency_mean_s).
    """

    output_min: int
    output_max: int
    tool_latency_mean_s: float
    shared_system_prompt: bool
    system_min: int = 1500
    system_max: int = 3000
    task_size: int = 40
    steps_min: int = 8
    steps_max: int = 20
    tool_median: int = 600
    tool_sigma: float = 0.8
    tool_min: int = 100
    tool_max: int = 4000
    seed: int = 0

    def __post_init__(self) -> None:
        for lo, hi in (("system_min", "system_max"), ("steps_min", "steps_max"),
                       ("tool_min", "tool_max"), ("output_min", "output_max")):
            if not 1 <= getattr(self, lo) <= getattr(self, hi):
                raise ValueError(f"need 1 <= {lo} <= {hi}, "
                                 f"got {getattr(self, lo)} and {getattr(self, hi)}")

    def draw_system_size(self, rng: random.Random) -> int:
        return rng.randint(self.system_min, self.system_max)

    def _draw_tool_result_size(self, rng: random.Random) -> int:
        drawn = rng.lognormvariate(math.log(self.tool_median), self.tool_sigma)
        return int(min(self.tool_max, max(self.tool_min, drawn)))

    def draw_turns(self, rng: random.Random,
                   fill: Callable[[random.Random, int], str] | None = None) -> list[DrawnTurn]:
        """One session's turns: the task, then tool results. `fill(rng, size)` makes each turn's
        text right after its size is drawn (text sessions); without it no text is drawn."""
        out = []
        for k in range(rng.randint(self.steps_min, self.steps_max)):
            size = self.task_size if k == 0 else self._draw_tool_result_size(rng)
            text = fill(rng, size) if fill is not None else ""
            # a fixed length draws nothing, so fixed-length sessions keep the draws they always had
            output = (self.output_min if self.output_min == self.output_max
                      else rng.randint(self.output_min, self.output_max))
            out.append(DrawnTurn(size, text, output, exponential(rng, self.tool_latency_mean_s)))
        return out
