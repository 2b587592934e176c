"""Replays sessions against one server: Poisson session arrivals, turns in order, think times."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from ..workloads.text_sessions import TextSession, start_offsets
from . import client
from .client import RequestRecord


def _generate_prompt(sess: TextSession, history: list[tuple[str, str]], user: str) -> str:
    # A fixed plain-text template: each turn's prompt extends the previous prompt + answer exactly,
    # so a prefix cache can hit on the whole history.
    parts = [sess.system + "\n\n"] if sess.system else []
    for i, (u, a) in enumerate(history):
        parts.append(f"{_role(sess, i)}: {u}\nassistant: {a}\n")
    parts.append(f"{_role(sess, len(history))}: {user}\nassistant:")
    return "".join(parts)


def _role(sess: TextSession, i: int) -> str:
    return "user" if i == 0 else sess.role


def _chat_messages(sess: TextSession, history: list[tuple[str, str]], user: str) -> list[dict]:
    msgs = [{"role": "system", "content": sess.system}] if sess.system else []
    for u, a in history:
        msgs.append({"role": "user", "content": u})
        msgs.append({"role": "assistant", "content": a})
    msgs.append({"role": "user", "content": user})
    return msgs


async def run_sessions(base_url: str, label: str, sessions: list[TextSession], rate: float, *,
                       api: str = "generate", seed: int = 0, progress=None, model: str = "default",
                       timeout_s: float = 600.0) -> list[RequestRecord]:
    """Run every session to completion; return one record per request in completion order."""
    if api not in ("generate", "chat"):
        raise ValueError(f"api must be 'generate' or 'chat', got {api!r}")
    records: list[RequestRecord] = []
    offsets = start_offsets(len(sessions), rate, seed)
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    conn = aiohttp.TCPConnector(limit=0)

    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
        async def one(sess: TextSession, offset: float) -> None:
            await asyncio.sleep(offset)  # pacing of the arrival process, not a wait for a state
            history: list[tuple[str, str]] = []
            for i, turn in enumerate(sess.turns):
                rec = RequestRecord(sess.id, i, label, 0.0)
                if api == "generate":
                    await client.generate(http, base_url,
                                          _generate_prompt(sess, history, turn.user),
                                          turn.max_tokens, rec, t0)
                else:
                    await client.chat(http, base_url, _chat_messages(sess, history, turn.user),
                                      turn.max_tokens, rec, t0, model=model)
                records.append(rec)
                if progress is not None:
                    progress.update(1)
                if rec.error:
                    return
                history.append((turn.user, rec.text))
                if turn.think_s > 0 and i + 1 < len(sess.turns):
                    await asyncio.sleep(turn.think_s)

        await asyncio.gather(*(one(s, o) for s, o in zip(sessions, offsets)))
    return records


async def flush(base_url: str) -> bool:
    async with aiohttp.ClientSession() as http:
        return await client.flush_cache(http, base_url)


async def warmup(base_url: str, api: str, model: str = "default") -> None:
    """One short untimed request (the first request to a fresh server pays one-off costs)."""
    async with aiohttp.ClientSession() as http:
        rec = RequestRecord("warmup", 0, "warmup", 0.0)
        if api == "generate":
            await client.generate(http, base_url, "warm up", 2, rec, time.perf_counter())
        else:
            await client.chat(http, base_url, [{"role": "user", "content": "warm up"}], 2, rec,
                              time.perf_counter(), model=model)
