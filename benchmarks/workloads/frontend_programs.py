"""Agent sessions as the arguments of an SGLang frontend program (benchmarks/loadgen/frontend.py).

Rendered from an AgentWorkload through text_sessions.agent_sessions, so the sizes and the seed are
those of the load generator's text agent sessions: the task is the first turn, and the tool results
that follow are grouped `fanout` at a time into steps of parallel tool calls (the program forks once
per call). Nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

from .specs import AgentWorkload
from .text_sessions import agent_sessions


@dataclass(frozen=True)
class AgentProgram:
    """One agent session: the program's keyword arguments (`as_kwargs`) and its output budget."""

    id: str
    system: str
    task: str
    steps: tuple[tuple[str, ...], ...]  # per step, the results of its parallel tool calls
    tool_wait_s: tuple[float, ...]  # per step, how long its calls run (the slowest call's latency)
    max_tokens: int  # every sgl.gen of the program

    def as_kwargs(self) -> dict:
        return {"system": self.system, "task": self.task, "steps": [list(s) for s in self.steps],
                "tool_wait_s": list(self.tool_wait_s), "max_tokens": self.max_tokens}

    @property
    def gen_calls(self) -> int:
        """sgl.gen calls one run makes: the plan, one note per tool call, one decision per step."""
        return 1 + sum(len(s) for s in self.steps) + len(self.steps)


def agent_programs(w: AgentWorkload, count: int, fanout: int) -> list[AgentProgram]:
    """`count` programs; each answer is `w.output_max` tokens (the budget of every sgl.gen). A tool
    call's latency is the wait its text turn draws after the previous answer."""
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1 (tool calls per step), got {fanout}")
    out = []
    for sess in agent_sessions(w, count):
        turns = sess.turns
        starts = range(1, len(turns), fanout)  # turn index of each step's first tool result
        steps = tuple(tuple(t.user for t in turns[i:i + fanout]) for i in starts)
        # the wait drawn after answer i - 1 is the latency of the tool whose result is turn i
        waits = tuple(max(t.think_s for t in turns[i - 1:min(i + fanout, len(turns)) - 1])
                      for i in starts)
        out.append(AgentProgram(sess.id, sess.system, turns[0].user, steps, waits, w.output_max))
    return out
