"""Agent programs written in SGLang's frontend language, run against a server through
RuntimeEndpoint.

The program (`tool_agent`, an `sgl.function`): a system prompt and a task, a plan (`sgl.gen`), then
one step per group of parallel tool calls: the state forks once per call (`s.fork`), each branch
reads its tool result and writes a note, the branches join, every result is appended to the
transcript and the agent decides (`sgl.gen`) what to do next. The transcript grows with every step
and the branches share its prefix, which is the traffic a prefix cache serves. Generation is greedy
(temperature 0), so two servers with the same weights must produce the same text.

Arguments come from workloads/frontend_programs.py. `import sglang` is slow (seconds), so it
happens on first use, not at import.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..workloads.frontend_programs import AgentProgram
from ..workloads.text_sessions import start_offsets
from .stats import pct

_PROGRAM = None


def tool_agent():
    """The agent program as an `sgl.function` (built once)."""
    global _PROGRAM
    if _PROGRAM is None:
        import sglang as sgl

        @sgl.function
        def agent(s, system, task, steps, tool_wait_s, max_tokens):
            s += sgl.system(system)
            s += sgl.user(task)
            s += sgl.assistant(sgl.gen("plan", max_tokens=max_tokens))
            for k, results in enumerate(steps):
                if tool_wait_s[k] > 0:
                    # the tools run (stated latency), no request in flight
                    time.sleep(tool_wait_s[k])
                calls = s.fork(len(results))  # parallel tool calls share the transcript so far
                for call, result in zip(calls, results):
                    call += sgl.user(result)
                    call += sgl.assistant(sgl.gen(f"note{k}", max_tokens=max_tokens))
                calls.join()  # s[f"note{k}"] = the branches' notes, in call order
                s += sgl.user("\n".join(results))  # the transcript grows by every tool result
                s += sgl.assistant(sgl.gen(f"step{k}", max_tokens=max_tokens))

        _PROGRAM = agent
    return _PROGRAM


def endpoint(base_url: str, chat_template: str | None = None):
    """A RuntimeEndpoint for `base_url`; the chat template is chosen from the model path unless
    named."""
    import sglang as sgl

    return sgl.RuntimeEndpoint(base_url, chat_template_name=chat_template)


@dataclass
class ProgramRecord:
    """One program run: latency, token counts of the main transcript's gens, every output."""

    program: str
    server: str
    t_start: float = 0.0  # seconds since the run began
    latency: float | None = None
    gen_calls: int = 0
    prompt_tokens: int = 0  # of the main transcript's gens (plan, step decisions)
    cached_tokens: int = 0
    outputs: dict = field(default_factory=dict)  # plan, note<k> (list per step), step<k>
    error: str | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


def run_program(backend, prog: AgentProgram, label: str, t0: float) -> ProgramRecord:
    """Run `prog` to completion (greedy) and record it; an error is recorded, not raised."""
    rec = ProgramRecord(prog.id, label, time.perf_counter() - t0)
    start = time.perf_counter()
    try:
        state = tool_agent().run(**prog.as_kwargs(), backend=backend, temperature=0.0,
                                 ignore_eos=True)
        state.text()  # waits for the program to finish
        if state.error() is not None:
            raise state.error()
        names = ["plan"] + [n for k in range(len(prog.steps)) for n in (f"note{k}", f"step{k}")]
        rec.outputs = {n: state[n] for n in names}
        for n in ["plan"] + [f"step{k}" for k in range(len(prog.steps))]:
            meta = state.get_meta_info(n) or {}
            rec.prompt_tokens += meta.get("prompt_tokens", 0)
            rec.cached_tokens += meta.get("cached_tokens", 0)
        rec.gen_calls = prog.gen_calls
    except Exception as exc:  # a failed program is a measurement (an error count), not a crash
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.latency = time.perf_counter() - start
    return rec


def run_programs(base_url: str, label: str, programs: list[AgentProgram], rate: float, *,
                 seed: int = 0, chat_template: str | None = None,
                 progress=None) -> list[ProgramRecord]:
    """Start the programs as Poisson arrivals at `rate` per second; return records in program
    order."""
    backend = endpoint(base_url, chat_template)
    offsets = start_offsets(len(programs), rate, seed)
    t0 = time.perf_counter()

    def one(prog: AgentProgram, offset: float) -> ProgramRecord:
        # pacing of arrivals, not a wait for state
        time.sleep(max(0.0, t0 + offset - time.perf_counter()))
        rec = run_program(backend, prog, label, t0)
        if progress is not None:
            progress.update(1)
        return rec

    with ThreadPoolExecutor(max_workers=max(1, len(programs))) as pool:
        return list(pool.map(one, programs, offsets))


def summarize(records: list[ProgramRecord | dict]) -> dict:
    """Program latency percentiles (s), error count, and the main transcript's prefix-hit rate."""
    get = (lambda r, k: r[k]) if records and isinstance(records[0], dict) else getattr
    ok = [r for r in records if get(r, "error") is None]
    lat = [get(r, "latency") for r in ok]
    prompt = sum(get(r, "prompt_tokens") for r in ok)
    out = {"programs": len(records), "ok": len(ok), "errors": len(records) - len(ok),
           "gen_calls": sum(get(r, "gen_calls") for r in ok),
           "cache_hit_rate": ((sum(get(r, "cached_tokens") for r in ok) / prompt)
                              if prompt else None)}
    for q in (50, 90, 99):
        out[f"latency_p{q}"] = pct(lat, q)
    return out


def format_summary(label: str, s: dict) -> str:
    hit = "-" if s["cache_hit_rate"] is None else f"{s['cache_hit_rate']:.1%}"
    lat = "  ".join(f"P{q} {s[f'latency_p{q}']:.2f} s" for q in (50, 90, 99)
                    if s[f"latency_p{q}"] is not None)
    wall = f", {s['wall_s']:.1f} s" if s.get("wall_s") is not None else ""
    return (f"== {label}: {s['ok']}/{s['programs']} agent programs ok{wall}, "
            f"{s['gen_calls']} sgl.gen calls, transcript cache hit {hit}\nprogram latency  {lat}")
