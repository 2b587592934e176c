"""The node benchmark's traffic: the same requests in every run, sent by async phases.

The three runs' servers stay up together (runner.run_node); each run's traffic goes in phases:
1. steady (each run in turn, the other runs' servers idle): the busy model gets turns
   1..`plan.turns` of `plan.conversations` real ShareGPT conversations, interleaved turn by turn
   (each conversation's history is evicted before its next turn once the histories outgrow the
   pool), one request at a time, each turn carrying the whole history with the model's own
   answers; meanwhile the donor gets light traffic, `plan.donor_requests` turns of its own
   conversations, one every `plan.donor_interval_s` (or later, if the previous one is still
   running). The busy model's headline figures come from this phase.
2. bursts (`plan.burst_rounds` rounds, the runs' bursts back to back in each round, in an order
   that rotates by one each round): the donor gets `plan.burst_requests` requests (one long
   ShareGPT message each, cut to `plan.burst_tokens_each` tokens) in one batched `/generate` of
   token ids, which SGLang hands its scheduler as one message (concurrent calls reached the
   scheduler loop by chance in one, two or three batches, and that chance decided the donor's
   P99). Every busy server is idle meanwhile. The round structure is what makes the donor's
   P99 comparable: one forward's time on this shared machine moves 10-20% within seconds
   whatever runs (docs/node_bench.md), so one burst per run, minutes apart, was a coin toss;
   rounds put the three runs' bursts under the same conditions and the P99 over several rounds
   is their upper tail, not one sample of it. After its burst (but in the last round) each
   donor's cache is flushed (the burst's prompts would otherwise stay cached), and the
   SwiftCache donor lends again before the next burst of any donor goes (runner._burst_rounds).
3. reclaim: each run's busy conversations get their next turn (`busy_reclaim`): the borrower
   serving once its loan is gone. (A reclaim that meets a copy in flight is
   `tests/unit/test_runtime.py`'s
   `test_reclaim_is_acked_from_the_agent_thread_once_the_copy_in_flight_stopped`, and the
   layer stream's `test_reclaim_and_dead_donor_mid_forward_leave_every_read_unchanged`.)
Every request is greedy (temperature 0) with a fixed output length, so outputs can be compared
across runs request by request.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..loadgen.client import RequestRecord, chat, flush_when_idle, generate_batch
from ..workloads.sharegpt import Conversation, load_conversations
from .plan import NodePlan

BURST_SCAN = 400  # conversations searched, in file order, for messages long enough to burst


@dataclass(frozen=True)
class Traffic:
    busy: tuple[Conversation, ...]  # plan.turns steady turns, then one for the reclaim phase
    donor: tuple[Conversation, ...]
    burst: tuple[tuple[int, ...], ...]  # one prompt per burst request, as token ids


def build_traffic(plan: NodePlan, tokenizer_json: Path) -> Traffic:
    """Pick the conversations and burst prompts (deterministic: ShareGPT file order)."""
    from tokenizers import Tokenizer

    busy = load_conversations(plan.conversations, min_turns=plan.turns + 1,
                              max_chars_per_message=plan.max_chars)
    busy = [Conversation(c.id, c.turns[:plan.turns + 1]) for c in busy]
    donor_turns = math.ceil(plan.donor_requests / plan.donor_conversations)
    taken = {c.id for c in busy}
    donor = [c for c in load_conversations(plan.conversations + plan.donor_conversations + 50,
                                           min_turns=donor_turns,
                                           max_chars_per_message=plan.max_chars)
             if c.id not in taken][:plan.donor_conversations]
    if len(donor) < plan.donor_conversations:
        raise RuntimeError(f"found {len(donor)} ShareGPT conversations with {donor_turns} turns "
                           f"for the donor, need {plan.donor_conversations}")
    taken |= {c.id for c in donor}
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    burst = long_messages(load_conversations(BURST_SCAN), taken, tokenizer,
                          plan.burst_tokens_each, plan.burst_requests)
    ids = tuple(tuple(tokenizer.encode(text).ids) for text in burst)
    return Traffic(tuple(busy), tuple(donor), ids)


def long_messages(convs: list[Conversation], exclude: set[str], tokenizer, tokens: int,
                  count: int) -> list[str]:
    """The first `count` user messages (file order, one per conversation, none from `exclude`)
    with at least `tokens` tokens, each cut at its `tokens`-th token."""
    out: list[str] = []
    for conv in convs:
        if conv.id in exclude:
            continue
        for turn in conv.turns:
            enc = tokenizer.encode(turn.user)
            if len(enc.ids) >= tokens:
                out.append(turn.user[:enc.offsets[tokens - 1][1]])
                break
        if len(out) == count:
            return out
    raise RuntimeError(f"only {len(out)} of the first {len(convs)} ShareGPT conversations have a "
                       f"message of {tokens} tokens; lower the burst size (--burst-fraction) or "
                       f"raise --burst-requests")


@dataclass
class Marks:
    """Seconds since the run's t0 (the sampler's clock too) of the traffic's phases."""

    t0: float
    steady_end: float | None = None
    bursts: list[tuple[float, float]] = field(default_factory=list)  # (start, end) per round
    traffic_end: float | None = None

    def now(self) -> float:
        return time.perf_counter() - self.t0


async def _send(http, url: str, messages: list[dict], max_tokens: int, session: str, turn: int,
                label: str, t0: float) -> RequestRecord:
    rec = RequestRecord(session=session, turn=turn, server=label, t_send=0.0)
    await chat(http, url, messages, max_tokens, rec, t0)
    if rec.error:
        raise RuntimeError(f"{label} request {session} turn {turn} failed: {rec.error}")
    return rec


class BusyReplay:
    """The busy model's conversations, interleaved turn by turn; histories carry over between
    calls, so the reclaim phase continues the steady phase's conversations."""

    def __init__(self, url: str, traffic: Traffic, plan: NodePlan, t0: float) -> None:
        self.url, self.traffic, self.plan, self.t0 = url, traffic, plan, t0
        self.histories: list[list[dict]] = [[] for _ in traffic.busy]

    async def turns(self, http, first: int, stop: int) -> list[RequestRecord]:
        """Turns first+1..stop (1-based in the records) of every conversation, round-robin."""
        records: list[RequestRecord] = []
        for i in range(first, stop):
            for conv, messages in zip(self.traffic.busy, self.histories):
                messages.append({"role": "user", "content": conv.turns[i].user})
                rec = await _send(http, self.url, list(messages), self.plan.max_tokens,
                                  conv.id, i + 1, "busy", self.t0)
                messages.append({"role": "assistant", "content": rec.text})
                records.append(rec)
        return records


async def _donor_light(http, url, traffic: Traffic, plan: NodePlan,
                       t0: float) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    histories: list[list[dict]] = [[] for _ in traffic.donor]
    start = time.perf_counter()
    for k in range(plan.donor_requests):
        # an open schedule: request k goes at start + k x interval, or when k-1 is done
        await asyncio.sleep(max(0.0, start + k * plan.donor_interval_s - time.perf_counter()))
        j, turn = k % len(traffic.donor), k // len(traffic.donor)
        conv, messages = traffic.donor[j], histories[j]
        messages.append({"role": "user", "content": conv.turns[turn].user})
        rec = await _send(http, url, list(messages), plan.donor_max_tokens, conv.id, turn + 1,
                          "donor", t0)
        messages.append({"role": "assistant", "content": rec.text})
        records.append(rec)
    return records


def warm_up_donor(url: str, traffic: Traffic, timeout_s: float = 300.0) -> None:
    """Before any traffic (and before the busy server starts, so nothing is lent yet): one
    batched /generate of the burst's shape (its prompts, each rotated by one token, one output
    token), then /flush_cache so nothing of it stays cached. The first forward of a size a
    process has not run before touches fresh memory (7,000 page faults and +30 ms for the
    burst's 6 x 409 tokens on this machine, by an amount that varies from run to run), and
    the burst was each run's first; so every run's donor, stock or not, has run one."""
    asyncio.run(_warm_up_donor(url, traffic, timeout_s))


async def _warm_up_donor(url: str, traffic: Traffic, timeout_s: float) -> None:
    import aiohttp

    prompts = [list(ids[1:] + ids[:1]) for ids in traffic.burst]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        async with http.post(url.rstrip("/") + "/generate", json=body) as resp:
            resp.raise_for_status()
            await resp.read()
        # SGLang flushes only an idle server; the last request may still be finishing
        await flush_when_idle(http, url, timeout_s=30.0, poll_s=0.2)


def session():
    """The aiohttp session every phase sends through (no connection limit, 15 min timeout)."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                 connector=aiohttp.TCPConnector(limit=0))


async def steady(busy_url: str, donor_url: str, traffic: Traffic, plan: NodePlan,
                 replay: BusyReplay, marks: Marks) -> dict[str, list[RequestRecord]]:
    """Phase 1: the busy turns 1..plan.turns and the donor's light traffic, side by side."""
    async with session() as http:
        busy, donor = await asyncio.gather(replay.turns(http, 0, plan.turns),
                                           _donor_light(http, donor_url, traffic, plan, marks.t0))
    marks.steady_end = marks.now()
    return {"busy": busy, "donor": donor}


async def burst(http, url: str, traffic: Traffic, plan: NodePlan, marks: Marks,
                round_no: int) -> list[RequestRecord]:
    """One round's burst on one donor: records `burst-<i>`, turn `round_no + 1`."""
    start = marks.now()
    records = [RequestRecord(session=f"burst-{i}", turn=round_no + 1, server="burst",
                             t_send=0.0) for i in range(len(traffic.burst))]
    await generate_batch(http, url, [list(ids) for ids in traffic.burst], plan.burst_max_tokens,
                         records, marks.t0)
    for rec in records:
        if rec.error:
            raise RuntimeError(f"burst request {rec.session} (round {round_no + 1}) failed: "
                               f"{rec.error}")
    marks.bursts.append((start, marks.now()))
    return records


def round_order(keys: list[str], round_no: int) -> list[str]:
    """The runs' order in a round: rotated by one each round, so no run always goes first."""
    k = round_no % len(keys)
    return keys[k:] + keys[:k]


async def flush_donor(http, url: str) -> None:
    """A donor's cache flushed once it is idle (its last decode may still be finishing), so its
    next burst is computed again and a SwiftCache donor has room to lend."""
    await flush_when_idle(http, url, timeout_s=30.0, poll_s=0.2)


async def flush_donors(urls: list[str]) -> None:
    """Every donor flushed (`flush_donor`), one after another."""
    async with session() as http:
        for url in urls:
            await flush_donor(http, url)
