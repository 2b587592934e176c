"""Workloads: one description of chat and agent traffic, rendered as text sessions and token
traces."""

import random
from dataclasses import replace

import pytest

from benchmarks.workloads.specs import AgentWorkload, Arrivals, ChatWorkload, tokens_in
from benchmarks.workloads.text_sessions import agent_sessions, chat_sessions, start_offsets
from benchmarks.workloads.token_traces import CONTEXT_WINDOW, agent_traces, chat_traces, page_ids

# the load generator's agent defaults before the workloads were merged
LOADGEN_AGENT = AgentWorkload(output_min=48, output_max=48, tool_latency_mean_s=0.5,
                              shared_system_prompt=False)
SIM_AGENT = AgentWorkload(output_min=16, output_max=128, tool_latency_mean_s=2.0,
                          shared_system_prompt=True)


def test_agent_sessions_are_seeded_and_follow_the_stated_bounds():
    """Same workload and seed give the same sessions, another seed others; sizes stay in bounds."""
    spec = replace(LOADGEN_AGENT, seed=3)
    a, b = agent_sessions(spec, 5), agent_sessions(spec, 5)
    assert a == b
    assert agent_sessions(replace(LOADGEN_AGENT, seed=4), 5) != a
    for s in a:
        assert spec.steps_min <= len(s.turns) <= spec.steps_max
        assert spec.system_min <= len(s.system.split()) - 6 <= spec.system_max
        for st in s.turns[1:]:
            assert spec.tool_min <= len(st.user.split()) - 2 <= spec.tool_max


def test_chat_sessions_keep_real_turn_order():
    """Chat sessions keep min_turns..max_turns turns and answers within the output cap."""
    sess = chat_sessions(ChatWorkload(max_turns=4, min_turns=2, max_chars_per_message=100,
                                      max_output_tokens=128, think_mean_s=2.0, seed=1), 3)
    assert len(sess) == 3
    assert all(2 <= len(s.turns) <= 4 for s in sess)
    assert all(1 <= st.max_tokens <= 128 for s in sess for st in s.turns)


def test_poisson_arrivals_have_the_requested_mean_gap():
    """Counted arrivals start at 0, never go back in time, and have mean gap 1 / rate."""
    t = start_offsets(4000, rate=2.0, seed=0)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert (t[-1] / (len(t) - 1)) == pytest.approx(0.5, rel=0.06)


def test_windowed_arrivals_stay_in_the_window_at_the_requested_rate():
    """Windowed arrivals lie in (0, window), ascend, and number about rate x window."""
    t = Arrivals(rate=4.0, window_s=1000.0).start_times(random.Random(0))
    assert 0.0 < t[0] and t[-1] < 1000.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert len(t) == pytest.approx(4000, rel=0.06)


def test_arrivals_need_exactly_one_bound():
    """An Arrivals with neither or both of count and window is refused, naming both."""
    with pytest.raises(ValueError, match="count=N sessions or window_s=seconds"):
        Arrivals(rate=1.0)
    with pytest.raises(ValueError, match="exactly one bound"):
        Arrivals(rate=1.0, count=3, window_s=10.0)


def test_conversation_offset_skips_that_many_conversations():
    """The selector with offset k returns the conversations k.. of the offset-0 file order."""
    w = ChatWorkload(max_turns=4, think_mean_s=1.0, max_chars_per_message=200)
    assert replace(w, conversation_offset=5).conversations(3) == w.conversations(8)[5:]


def test_text_sessions_and_token_traces_replay_the_same_chat():
    """One ChatWorkload rendered both ways: same conversations, turns, prompt and answer sizes,
    think times."""
    w = ChatWorkload(max_turns=3, min_turns=2, max_chars_per_message=2000, think_mean_s=1.0, seed=2)
    text = chat_sessions(w, 6)
    traces = chat_traces(w, Arrivals(rate=1.0, count=6))
    assert len(text) == len(traces) == 6
    for s, tr in zip(text, traces):
        assert [tokens_in(t.user) for t in s.turns] == [t.new_tokens for t in tr.turns]
        assert [t.max_tokens for t in s.turns] == [t.output_tokens for t in tr.turns]
        assert [t.think_s for t in s.turns] == [t.think_s for t in tr.turns]


def test_token_traces_keep_each_sessions_turns_at_every_rate():
    """Session i has the same turns at every arrival rate; its start time scales as 1 / rate."""
    w = ChatWorkload(max_turns=4, think_mean_s=10.0, seed=3)
    slow = chat_traces(w, Arrivals(rate=0.5, window_s=400.0))
    fast = chat_traces(w, Arrivals(rate=2.0, window_s=400.0))
    assert len(fast) > len(slow) > 10
    for a, b in zip(slow, fast):
        assert a.turns == b.turns and a.sid == b.sid
        assert b.start == pytest.approx(a.start / 4)
    agents = [agent_traces(replace(SIM_AGENT, seed=1), Arrivals(rate=r, window_s=300.0))
              for r in (0.1, 0.3)]
    assert [s.turns for s in agents[0]] == [s.turns for s in agents[1][:len(agents[0])]]


def test_agent_traces_share_one_system_prompt_and_fit_the_context():
    """Shared-prompt agent traces: every session's first turn carries the one system prompt,
    which is their common radix prefix; outputs and tool results stay in bounds; contexts fit the
    window."""
    traces = agent_traces(replace(SIM_AGENT, seed=5), Arrivals(rate=0.2, window_s=200.0))
    assert len(traces) >= 2
    system = traces[0].shared_prefix_tokens
    assert SIM_AGENT.system_min <= system <= SIM_AGENT.system_max
    for s in traces:
        assert s.shared_prefix_tokens == system
        assert s.turns[0].new_tokens == system + SIM_AGENT.task_size
        assert all(SIM_AGENT.tool_min <= t.new_tokens <= SIM_AGENT.tool_max for t in s.turns[1:])
        assert all(SIM_AGENT.output_min <= t.output_tokens <= SIM_AGENT.output_max for t in s.turns)
        assert sum(t.new_tokens + t.output_tokens for t in s.turns) <= CONTEXT_WINDOW
    a, b = (page_ids(s, system + 640, 64) for s in traces[:2])
    shared_pages = system // 64
    assert a[:shared_pages] == b[:shared_pages]
    assert not set(a[shared_pages:]) & set(b[shared_pages:])


def test_text_agent_sessions_share_the_system_prompt_only_when_asked():
    """shared_system_prompt=True gives every text session the same system prompt; False,
    distinct ones."""
    shared = agent_sessions(replace(LOADGEN_AGENT, shared_system_prompt=True), 4)
    own = agent_sessions(LOADGEN_AGENT, 4)
    assert len({s.system for s in shared}) == 1
    assert len({s.system for s in own}) == 4


def test_frontend_programs_group_the_text_sessions_tool_results_into_parallel_steps():
    """Agent programs carry the text session's system prompt, task and every tool result in
    order, `fanout` per step; each step waits for its slowest call; gen_calls counts plan, notes,
    decisions."""
    from benchmarks.workloads.frontend_programs import agent_programs

    spec = replace(LOADGEN_AGENT, steps_min=6, steps_max=6, seed=2)
    sess = agent_sessions(spec, 1)[0]
    prog = agent_programs(spec, 1, fanout=2)[0]
    assert (prog.system, prog.task, prog.id) == (sess.system, sess.turns[0].user, sess.id)
    assert [r for step in prog.steps for r in step] == [t.user for t in sess.turns[1:]]
    assert [len(s) for s in prog.steps] == [2, 2, 1]
    waits = [t.think_s for t in sess.turns]
    assert prog.tool_wait_s == (max(waits[0:2]), max(waits[2:4]), waits[4])
    assert prog.gen_calls == 1 + 5 + 3 and prog.max_tokens == spec.output_max
    assert prog.as_kwargs()["steps"] == [list(s) for s in prog.steps]
    with pytest.raises(ValueError, match="fanout must be >= 1"):
        agent_programs(spec, 1, fanout=0)
