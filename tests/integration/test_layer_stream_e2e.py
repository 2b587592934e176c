"""The layer stream cache in a live server: a context 4x the local KV pool, token-identical.

Real SGLang CPU servers on the small model (8 layers): stock SGLang with a pool large enough for
everything (the reference), and SwiftCache with --swiftcache-layer-stream host, whose local KV
memory is that of a stock pool of LOCAL_POOL tokens: 2 staging layers of STREAMED_POOL rows
against 8 layers of LOCAL_POOL rows (each + 1 padding row). Invariants:
- the streamed server's local KV bytes equal a stock LOCAL_POOL pool's (its own log says so);
- a request whose context (prompt + output) is 4x LOCAL_POOL is served, through chunked prefill
  and decode, with greedy outputs identical to the reference;
- a radix-cache hit on that prompt (its prefix streamed from host memory) and two requests
  decoding side by side stay identical too;
- a prompt longer than the streamed pool gets an HTTP 400 that names the limits, and the server
  keeps serving.
"""

from __future__ import annotations

import json
import re
import urllib.error

import pytest
from integration.harness import LocalServer

from benchmarks.tools.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.integration
LAYERS, DEPTH = 8, 2
LOCAL_POOL = 200  # tokens a stock pool holds in the streamed server's local KV memory
STREAMED_POOL = LAYERS * (LOCAL_POOL + 1) // DEPTH - 1  # 803: same bytes, 2 of 8 layers
COMMON = ["--chunked-prefill-size", "256", "--dtype", "float32"]
NEW_TOKENS = 20
ROW_BYTES = 2 * 4 * 32 * 4  # K and V, 4 KV heads of 32, fp32: one token of one layer


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 101 + 11) % 1900 + 50 for i in range(n)]


def _generate(server, ids, new=NEW_TOKENS) -> list[int]:
    out = server.post("/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}, timeout=600)
    return out["output_ids"]


def _both(server, prompts) -> list[list[int]]:
    """The prompts as one batched /generate call: they arrive together, so both servers batch
    (and decode) them alike; outputs in prompt order."""
    outs = server.post("/generate", {"input_ids": prompts, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}, timeout=600)
    return [o["output_ids"] for o in outs]


def test_streamed_server_serves_four_times_its_local_pool_token_identical(stock_servers):
    model = ensure_tiny_model(shape="small")
    long_prompt = _prompt(4 * LOCAL_POOL - NEW_TOKENS)  # context = 4 x LOCAL_POOL
    hit_prompt = long_prompt[:500] + _prompt(150, salt=1)
    side_by_side = [_prompt(330, salt=2), _prompt(330, salt=3)]
    stock = stock_servers.get(model, 4096, COMMON)
    want = [_generate(stock, long_prompt), _generate(stock, hit_prompt),
            *_both(stock, side_by_side)]
    streamed_args = [*COMMON, "--swiftcache-layer-stream", "host",
                     "--swiftcache-layer-stream-depth", str(DEPTH),
                     "--swiftcache-layer-stream-resident-fraction", "0"]  # every row streamed
    with LocalServer(model, swiftcache=True, max_total_tokens=STREAMED_POOL,
                     extra_args=streamed_args, log_path="/tmp/swift-ls-streamed.log") as server:
        got = [_generate(server, long_prompt), _generate(server, hit_prompt),
               *_both(server, side_by_side)]
        with pytest.raises(urllib.error.HTTPError) as refused:
            _generate(server, _prompt(STREAMED_POOL + 50))
        body = json.loads(refused.value.read())
        assert _generate(server, _prompt(40, salt=4), new=4)  # still serving
        log = server.log_text()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}: streamed output differs from stock SGLang's"
    assert len(long_prompt) + len(got[0]) >= 4 * LOCAL_POOL
    assert refused.value.code == 400
    assert f"at most {STREAMED_POOL} tokens" in body["error"]["message"]
    line = re.search(r"KV pool of (\d+) tokens; local staging (\d+) of (\d+) layers "
                     r"\(([\d.]+) MiB\)", log)
    assert line, "the streamed server did not log its pool"
    assert (int(line[1]), int(line[2]), int(line[3])) == (STREAMED_POOL, DEPTH, LAYERS)
    stock_local_mib = LAYERS * (LOCAL_POOL + 1) * ROW_BYTES / 2**20
    assert abs(float(line[4]) - stock_local_mib) < 0.05
