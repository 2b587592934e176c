"""Stock HiCache (`--enable-hierarchical-cache`, SGLang's host KV pool and HiCacheController) serves
on SGLang's CPU engine through the stand-ins in sglang_swift.cpu_compat.hicache.

Invariants, on real CPU servers with the same small device pool:
- with HiCache (and again with the `file` L3 backend), a multi-turn replay whose histories do not
  fit the device pool gives the greedy outputs of a stock server without HiCache, token for token
  (up to float near-ties, `harness.same_greedy`);
- prefixes really came back from the host pool (`cached_tokens_details.host` > 0), so the outputs
  were computed from KV that went device -> host -> device through the stand-in copies;
- the plain run uses SGLang's default copy path (io backend `kernel`, host layout `page_first`),
  the `file` run the other one (`direct`, `page_first_direct`);
- with `file`, pages were written to the directory, and after /flush_cache (device and host
  emptied) the same replay is served from L3 (`cached_tokens_details.storage` > 0) with the same
  outputs.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from integration.harness import LocalServer, same_greedy

from benchmarks.loadgen.client import flush_when_idle
from benchmarks.workloads.sharegpt import load_conversations

pytestmark = pytest.mark.integration

POOL = 384  # device KV tokens: three histories of ~250-450 tokens each cannot all stay
CONVERSATIONS, TURNS, CHARS, MAX_TOKENS = 3, 4, 150, 10
ARGS = ["--enable-cache-report", "--dtype", "float32"]
HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "4"]
MAX_TIES = 2  # near-tie flips accepted out of CONVERSATIONS * TURNS responses


def ask(server: LocalServer, messages: list[dict]) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "logprobs": True, "top_logprobs": 2, "return_cached_tokens_details": True,
            "return_token_ids": True}
    return server.post("/v1/chat/completions", body)


def replay(server: LocalServer) -> tuple[list[dict], list[dict]]:
    """Turn-by-turn, conversations interleaved, so each one's history is evicted from the device
    pool by the others before its next turn. Returns the responses and each one's cached-token
    breakdown ({"device", "host"[, "storage"]}; {} when nothing was cached)."""
    convs = load_conversations(CONVERSATIONS, min_turns=TURNS, max_chars_per_message=CHARS)
    history: list[list[dict]] = [[] for _ in convs]
    responses, details = [], []
    for t in range(TURNS):
        for conv, messages in zip(convs, history):
            messages.append({"role": "user", "content": conv.turns[t].user})
            resp = ask(server, messages)
            responses.append(resp)
            details.append((resp.get("sglext") or {}).get("cached_tokens_details") or {})
            messages.append({"role": "assistant",
                             "content": resp["choices"][0]["message"]["content"]})
    return responses, details


def total(details: list[dict], source: str) -> int:
    return sum(d.get(source) or 0 for d in details)


def flush(server: LocalServer) -> None:
    async def run():
        async with aiohttp.ClientSession() as http:
            await flush_when_idle(http, server.base_url, 60.0)

    asyncio.run(run())


def check_same(got: list[dict], want: list[dict], what: str) -> None:
    ties = same_greedy(got, want)
    print(f"{what}: {len(got)} responses, near-tie flips at {ties}")
    assert len(ties) <= MAX_TIES, f"{what}: {len(ties)} near-tie flips (responses {ties})"


def test_hicache_serves_on_the_cpu_engine_like_stock(tiny_model, tmp_path, stock_servers):
    with LocalServer(tiny_model, swiftcache=False, max_total_tokens=POOL,
                     extra_args=ARGS + HICACHE, log_path=tmp_path / "hicache.log") as server:
        got, details = replay(server)
        log = server.log_text()
    want, stock_details = replay(stock_servers.get(tiny_model, POOL, ARGS))
    print(f"host hits {total(details, 'host')}, device hits {total(details, 'device')}; "
          f"stock device hits {total(stock_details, 'device')}")
    assert "--hicache-io-backend kernel, layout page_first" in log
    assert total(details, "host") > 0, "no prefix came back from the host pool: proves nothing"
    check_same(got, want, "HiCache against stock")


def test_hicache_file_backend_writes_and_reads_l3(tiny_model, tmp_path, stock_servers):
    store = tmp_path / "l3"
    store.mkdir()
    extra = {"file_storage_path": str(store), "prefetch_threshold": 16}
    args = ARGS + HICACHE + ["--hicache-io-backend", "direct",
                             "--hicache-mem-layout", "page_first_direct",
                             "--hicache-storage-backend", "file",
                             "--hicache-storage-backend-extra-config", json.dumps(extra)]
    with LocalServer(tiny_model, swiftcache=False, max_total_tokens=POOL, extra_args=args,
                     log_path=tmp_path / "hicache-file.log") as server:
        got, details = replay(server)
        pages = list(store.rglob("*.bin"))
        flush(server)  # device and host pools empty; L3 keeps its files
        again, details_again = replay(server)
        log = server.log_text()
    want, _ = replay(stock_servers.get(tiny_model, POOL, ARGS))
    print(f"first replay: host hits {total(details, 'host')}; {len(pages)} L3 files; after "
          f"flush: storage hits {total(details_again, 'storage')}, host "
          f"{total(details_again, 'host')}, device {total(details_again, 'device')}")
    assert "--hicache-io-backend direct, layout page_first_direct" in log
    assert pages, f"nothing was written to {store}"
    assert total(details, "host") > 0, "no prefix came back from the host pool"
    assert total(details_again, "storage") > 0, "nothing was read back from L3 after the flush"
    check_same(got, want, "HiCache+file against stock")
    check_same(again, want, "HiCache+file after flush (L3 hits) against stock")
