"""The traffic of SGLang's `benchmark/hicache/bench_multiturn.py`, run against one server.

What that benchmark does (v0.5.23), and what this module does the same way:
- prompts are random-id text (its `--disable-random-sample` path of `sample_random_requests`):
  for prompt i an offset drawn from numpy's generator seeded with `seed`, the ids
  `(offset + i + j) % vocab` for j < `request_length - special tokens the tokenizer adds`,
  decoded to text. The first `clients` prompts open the clients' histories; then
  `clients x max(rounds - 1, 1)` more are drawn the same way, the sub-questions, and each later
  round takes the LAST one left (a list pop);
- every client is ready at the start; a sender loop, while fewer than `max_parallel` requests
  are in flight (sent minus answered), pops a ready client (`ready_queue_policy` random: a
  uniform index from Python's generator seeded with `seed`; fifo: the oldest) and sends its
  history, then sleeps an exponential gap of mean 1 / `request_rate` (also when no client was
  ready); at `max_parallel` in flight it polls every 50 ms;
- a request is one streaming `/generate` of the history as text, greedy, `output_length` new
  tokens with `ignore_eos`; TTFT is the time to the first event with non-empty text; its
  answer text is appended to the history, then the next sub-question, and the client is ready
  again until it has had `rounds` rounds.
Python's generator serves both the ready-queue pops and the gaps in the order the sender calls
them, as the original's one global generator does, so the order follows the answers' timing.

Besides what the original records, each request keeps SGLang's own per-request times from the
final `meta_info` (`--enable-metrics`: `request_received_ts`, `queue_time`,
`forward_entry_time`, `prefill_finished_time`), for the phase timeline (`phases.py`).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..loadgen.client import _sse_events

POLL_S = 0.05  # the original's wait while max_parallel requests are in flight
# what SGLang puts in meta_info per request, kept as it comes: its times (--enable-metrics) and
# how often the request was retracted (taken out of a decode batch for room, then run again)
META_KEYS = ("request_received_ts", "queue_time", "forward_entry_time", "prefill_finished_time",
             "first_token_latency", "response_sent_to_client_ts", "num_retractions")


@dataclass(frozen=True)
class Workload:
    """bench_multiturn.py's options, by its names."""

    clients: int = 8
    rounds: int = 5
    request_length: int = 64
    output_length: int = 64
    max_parallel: int = 2
    request_rate: float = 1.0
    distribution: str = "poisson"
    ready_queue_policy: str = "random"
    sub_question_length: int = 0  # 0: request_length
    seed: int = 1

    def __post_init__(self) -> None:
        for name in ("clients", "rounds", "request_length", "output_length", "max_parallel"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.request_rate <= 0:
            raise ValueError(f"request_rate must be positive, got {self.request_rate}")
        if self.distribution not in ("poisson", "uniform"):
            raise ValueError(f"distribution is poisson or uniform, got {self.distribution!r}")
        if self.ready_queue_policy not in ("random", "fifo"):
            raise ValueError(f"ready_queue_policy is random or fifo, got "
                             f"{self.ready_queue_policy!r}")

    @property
    def requests(self) -> int:
        return self.clients * self.rounds


def random_id_prompts(n: int, length: int, vocab: int, special: int, np_rng: Any,
                      decode: Callable[[list[int]], str]) -> list[str]:
    """`n` prompts as `sample_random_requests(..., random_sample=False)` makes them: one offset
    per prompt from `np_rng.randint(0, vocab, size=n)`, then consecutive ids from it."""
    length = max(1, length - special)
    offsets = np_rng.randint(0, vocab, size=n)
    return [decode([int((offsets[i] + i + j) % vocab) for j in range(length)])
            for i in range(n)]


@dataclass
class Prompts:
    openings: list[str]  # one per client
    sub_questions: list[str]  # popped from the end

    @classmethod
    def build(cls, load: Workload, vocab: int, special: int,
              decode: Callable[[list[int]], str]) -> "Prompts":
        """The original's two draws, in its order, from numpy's generator seeded with seed."""
        import numpy as np

        rng = np.random.RandomState(load.seed)
        first = random_id_prompts(load.clients, load.request_length, vocab, special, rng, decode)
        sub = load.sub_question_length or load.request_length
        rest = random_id_prompts(load.clients * max(load.rounds - 1, 1), sub, vocab, special,
                                 rng, decode)
        return cls(first, rest)


class ReadyQueue:
    """Clients ready to send, popped by policy (the original's ReadyQueue, single-threaded)."""

    def __init__(self, items: list, policy: str, rng: random.Random):
        self.items, self.policy, self.rng = list(items), policy, rng

    def append(self, item: Any) -> None:
        self.items.append(item)

    def pop(self) -> Any:
        if not self.items:
            return None
        if self.policy == "random":
            return self.items.pop(self.rng.randrange(len(self.items)))
        return self.items.pop(0)


def gap_s(load: Workload, rng: random.Random) -> float:
    if load.distribution == "poisson":
        return rng.expovariate(load.request_rate)
    return rng.uniform(0, 2 * (1.0 / load.request_rate))


@dataclass
class Turn:
    """One request: who sent it, when, and what came back (times in seconds; `t_send` and the
    meta times in Unix time)."""

    client: int
    round: int
    t_send: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    rid: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    meta: dict = field(default_factory=dict)
    error: str | None = None


def payload(prompt: str, output_length: int) -> dict:
    """The original's request body (`gen_payload`)."""
    return {"text": prompt, "stream": True, "lora_path": "", "return_logprob": False,
            "logprob_start_len": -1,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": output_length,
                                "ignore_eos": True}}


async def ask(url: str, body: dict, turn: Turn) -> None:
    """One streaming /generate, in its own HTTP session as the original opens one per request."""
    import aiohttp

    turn.t_send = time.time()
    start = time.perf_counter()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
            async with http.post(url + "/generate", json=body) as resp:
                if resp.status != 200:
                    turn.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return
                async for now, ev in _sse_events(resp):
                    if ev.get("text") and turn.ttft is None:
                        turn.ttft = now - start
                    turn.text = ev.get("text", turn.text)
                    turn.latency = now - start
                    meta = ev.get("meta_info") or {}
                    turn.rid = meta.get("id", turn.rid)
                    turn.prompt_tokens = meta.get("prompt_tokens", turn.prompt_tokens) or 0
                    turn.cached_tokens = meta.get("cached_tokens", turn.cached_tokens) or 0
                    turn.meta.update({k: meta[k] for k in META_KEYS if k in meta})
    except Exception as exc:  # noqa: BLE001 - reported; the run stops on it
        turn.error = f"{type(exc).__name__}: {exc}"


async def drive(url: str, load: Workload, prompts: Prompts,
                send: Callable = ask) -> list[Turn]:
    """One run of the workload against `url`; the turns in the order they were answered.
    Raises RuntimeError on a failed request (the original stops on one too)."""
    rng = random.Random(load.seed)
    history = list(prompts.openings)
    sub = list(prompts.sub_questions)
    ready = ReadyQueue([(c, 0) for c in range(load.clients)], load.ready_queue_policy, rng)
    turns: list[Turn] = []
    sent = answered = 0
    tasks = []

    async def one(c: int, r: int) -> None:
        nonlocal answered
        turn = Turn(c, r)
        await send(url, payload(history[c], load.output_length), turn)
        if turn.error or turn.ttft is None:
            raise RuntimeError(f"client {c} round {r + 1}: {turn.error or 'no text came back'}")
        turns.append(turn)
        history[c] += turn.text
        if r + 1 < load.rounds:
            history[c] += sub.pop()
            ready.append((c, r + 1))
        answered += 1

    while True:
        if sent - answered < load.max_parallel:
            item = ready.pop()
            if item is not None:
                tasks.append(asyncio.ensure_future(one(*item)))
                sent += 1
        else:
            await asyncio.sleep(POLL_S)
            _raise_failed(tasks)
            continue
        if answered == load.requests:
            break
        _raise_failed(tasks)
        await asyncio.sleep(gap_s(load, rng))
    await asyncio.gather(*tasks)
    return turns


def _raise_failed(tasks: list) -> None:
    for t in tasks:
        if t.done() and t.exception() is not None:
            raise t.exception()
