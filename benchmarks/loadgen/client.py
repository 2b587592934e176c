"""Streaming HTTP client for SGLang's `/generate` and OpenAI-style `/v1/chat/completions`.

Both stream server-sent events (`data: {...}` lines, ending with `data: [DONE]`). TTFT is the time
to the first event that carries output; inter-token latencies are the gaps between output events,
divided by the tokens each event added when the server reports counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestRecord:
    session: str
    turn: int
    server: str
    t_send: float  # wall seconds since the run started
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""
    error: str | None = None
    # the generated token ids (what identity is compared on: two ids can decode alike)
    output_ids: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d.pop("text")
        d.pop("output_ids")
        return d


async def _sse_events(resp: aiohttp.ClientResponse):
    """Yield (arrival_time, payload dict) per SSE `data:` line; stops at [DONE]."""
    buf = b""
    async for chunk in resp.content.iter_any():
        now = time.perf_counter()
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield now, json.loads(data)


async def generate(http: aiohttp.ClientSession, base_url: str, prompt: str, max_tokens: int,
                   rec: RequestRecord, t0: float) -> RequestRecord:
    """POST /generate with streaming; fills `rec` (times relative to the send)."""
    start = await _stream_generate(http, base_url, {"text": prompt}, max_tokens, [rec], t0)
    rec.e2e = time.perf_counter() - start
    return rec


async def generate_batch(http: aiohttp.ClientSession, base_url: str,
                         input_ids: list[list[int]], max_tokens: int, recs: list[RequestRecord],
                         t0: float) -> list[RequestRecord]:
    """POST one /generate of several pre-tokenized prompts with streaming; fills `recs[i]` for
    prompt i (times relative to the one send). SGLang sends a batch of token ids to its
    scheduler as one message, so the prompts arrive there together."""
    await _stream_generate(http, base_url, {"input_ids": input_ids}, max_tokens, recs, t0)
    return recs


async def _stream_generate(http: aiohttp.ClientSession, base_url: str, prompt: dict,
                           max_tokens: int, recs: list[RequestRecord], t0: float) -> float:
    """POST /generate of `prompt` (`text` or `input_ids`, one prompt or a batch) with streaming,
    greedy; each event fills `recs[its index]` (`e2e`: to that prompt's last event). Returns the
    send time (`time.perf_counter()`); an HTTP or connection error goes into every record."""
    payload = {**prompt, "stream": True,
               "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0,
                                   "ignore_eos": True}}
    start = time.perf_counter()
    last_t, last_n = [None] * len(recs), [0] * len(recs)
    for rec in recs:
        rec.t_send = start - t0
    try:
        async with http.post(base_url.rstrip("/") + "/generate", json=payload) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                for rec in recs:
                    rec.error = error
                return start
            async for now, ev in _sse_events(resp):
                i = ev.get("index", 0)
                rec, meta = recs[i], ev.get("meta_info", {})
                n = meta.get("completion_tokens", last_n[i] + 1)
                text = ev.get("text", "")
                if n <= last_n[i] and not text:
                    continue
                if rec.ttft is None:
                    rec.ttft = now - start
                elif n > last_n[i]:
                    rec.itls.extend([(now - last_t[i]) / (n - last_n[i])] * (n - last_n[i]))
                last_t[i], last_n[i] = now, n
                rec.text = text
                got = ev.get("output_ids") or []  # cumulative or deltas, by SGLang's options
                rec.output_ids = list(got) if len(got) == n else rec.output_ids + list(got)
                rec.prompt_tokens = meta.get("prompt_tokens", rec.prompt_tokens)
                rec.cached_tokens = meta.get("cached_tokens", rec.cached_tokens)
                rec.completion_tokens = n
                rec.e2e = now - start
    except aiohttp.ClientError as exc:
        for rec in recs:
            rec.error = f"{type(exc).__name__}: {exc}"
    return start


async def flush_when_idle(http: aiohttp.ClientSession, base_url: str, timeout_s: float,
                          poll_s: float = 0.5) -> float:
    """Flush the server's cache; SGLang refuses while requests run, so retry every `poll_s`
    until it is idle. Returns the seconds it took; raises after `timeout_s`."""
    t0 = time.monotonic()
    while not await flush_cache(http, base_url):
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"{base_url}: /flush_cache refused for {timeout_s:.0f}s (the "
                               f"server never went idle)")
        await asyncio.sleep(poll_s)  # polling the server's idleness
    return time.monotonic() - t0


async def chat(http: aiohttp.ClientSession, base_url: str, messages: list[dict], max_tokens: int,
               rec: RequestRecord, t0: float, model: str = "default") -> RequestRecord:
    """POST /v1/chat/completions with streaming and usage; fills `rec`."""
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
               "temperature": 0.0, "ignore_eos": True,
               "stream_options": {"include_usage": True},
               "return_output_ids_in_sglext": True}  # SGLang: the ids, in the last chunk
    start = time.perf_counter()
    rec.t_send = start - t0
    last_t, pieces = None, []
    try:
        async with http.post(base_url.rstrip("/") + "/v1/chat/completions", json=payload) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for now, ev in _sse_events(resp):
                for ch in ev.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if not piece:
                        continue
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itls.append(now - last_t)
                    last_t = now
                    pieces.append(piece)
                ids = (ev.get("sglext") or {}).get("output_ids")
                if ids:
                    rec.output_ids = list(ids[0])
                usage = ev.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens", rec.cached_tokens)
    except aiohttp.ClientError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.text = "".join(pieces)
    rec.e2e = time.perf_counter() - start
    return rec


async def flush_cache(http: aiohttp.ClientSession, base_url: str) -> bool:
    """POST /flush_cache (SGLang); returns False where the server has no such endpoint."""
    try:
        async with http.post(base_url.rstrip("/") + "/flush_cache") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False
