"""Streamed admission per request in a live server: what fits locally is not streamed.

Real SGLang CPU servers on the small model (8 layers): stock SGLang with a large pool (the
reference), and SwiftCache with --swiftcache-layer-stream host at the default resident fraction
(half of the local KV memory is every layer's own rows), whose local KV memory is at most that of
a stock pool of LOCAL_POOL tokens. Each forward of the streamed server is traced
(SWIFTCACHE_FORWARD_TRACE: rows loaded from and written through to the store). Invariants:
- a short request, whose context fits in the free resident slots, is served identically to stock
  with no row loaded or written through: it runs as on a stock server;
- a long request (more than twice LOCAL_POOL), whose context does not fit locally, is served
  identically, its streamed part loaded every step: only what lies past the resident slots;
- a prompt beyond the pool gets SGLang's HTTP 400 naming the streaming limits.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error

import pytest
from integration.harness import LocalServer
from integration.test_layer_stream_e2e import (
    COMMON,
    DEPTH,
    LAYERS,
    LOCAL_POOL,
    ROW_BYTES,
    _generate,
    _prompt,
)

from benchmarks.instruments import instruments_env
from benchmarks.tools.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.integration
POOL = 500  # f = 0.5: R = f D N / (L (1 - f) + f D) = 100, on 512-byte rows: 96 resident
SHORT, LONG, NEW = 50, 430, 12


def _trace(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_requests_that_fit_locally_are_not_streamed(tmp_path, stock_servers):
    model = ensure_tiny_model(shape="small")
    short, long = _prompt(SHORT, salt=5), _prompt(LONG, salt=6)
    stock = stock_servers.get(model, 4096, COMMON)
    want = [_generate(stock, short, new=NEW), _generate(stock, long, new=NEW)]
    trace = str(tmp_path / "forwards.jsonl")
    args = [*COMMON, "--swiftcache-layer-stream", "host", "--swiftcache-layer-stream-depth",
            str(DEPTH)]
    with LocalServer(model, swiftcache=True, max_total_tokens=POOL, extra_args=args,
                     env=instruments_env(forward_trace=trace),
                     log_path=tmp_path / "streamed.log") as server:
        before = len(_trace(trace))
        got_short = _generate(server, short, new=NEW)
        short_forwards = _trace(trace)[before:]
        got_long = _generate(server, long, new=NEW)
        long_forwards = _trace(trace)[before + len(short_forwards):]
        with pytest.raises(urllib.error.HTTPError) as refused:
            _generate(server, _prompt(POOL + 40))
        body = json.loads(refused.value.read())
        log = server.log_text()
    assert got_short == want[0], "a resident request's output differs from stock SGLang's"
    assert got_long == want[1], "a streamed request's output differs from stock SGLang's"

    line = re.search(r"KV pool of (\d+) tokens; local staging (\d+) of (\d+) layers "
                     r"\(([\d.]+) MiB\).*; (\d+) resident tokens", log)
    assert line, "the streamed server did not log its pool"
    resident = int(line[5])
    assert int(line[1]) == POOL and 0 < resident < SHORT + LONG
    assert float(line[4]) <= LAYERS * (LOCAL_POOL + 1) * ROW_BYTES / 2**20 + 0.05
    assert LONG + NEW > 2 * LOCAL_POOL

    assert short_forwards and all(f["streamed"] for f in short_forwards)
    assert sum(f["rows_loaded"] + f["rows_saved"] for f in short_forwards) == 0, \
        "a request that fits in the resident slots was streamed"
    decodes = [f for f in long_forwards if f["mode"] == "DECODE"]
    assert decodes and sum(f["rows_saved"] for f in long_forwards) > 0
    # Each decode step loads the context past the resident slots the long request got (those
    # the short one's cached tokens left free), every layer: some rows, never all of them.
    for f in decodes:
        context = f["seq_tokens"] - 1
        assert LAYERS * (context - resident) <= f["rows_loaded"] < LAYERS * context, f
    assert refused.value.code == 400
    assert f"at most {POOL} tokens" in body["error"]["message"]
