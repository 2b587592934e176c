"""Helpers for tests that start real SGLang servers on CPU.

    from integration.harness import LocalServer, tiny_model_dir
    with LocalServer(tiny_model_dir(), swiftcache=True, extra_args=["--enable-cache-report"]) as s:
        s.post("/generate", {...})

`LocalServer` binds 127.0.0.1 on a free port, waits for /health with a deadline, and kills the
server's whole process group on exit (see sglang_swift/local_server.py).
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from benchmarks.tools.local_server import LocalServer, ServerStartError, free_port  # noqa: F401


def tiny_model_dir() -> Path:
    """Build (once) and return the tiny Llama used by every integration test and the demo."""
    from benchmarks.tools.tiny_model import DEFAULT_DIR, ensure_tiny_model

    return ensure_tiny_model(DEFAULT_DIR, seed=0)


def chat(server: LocalServer, messages: list[dict], max_tokens: int = 12,
         top_logprobs: int = 0) -> dict:
    """One greedy /v1/chat/completions call; returns the parsed JSON response (with each
    generated token's `top_logprobs` candidates when asked, for `same_greedy`)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    if top_logprobs:
        body.update(logprobs=True, top_logprobs=top_logprobs)
    return server.post("/v1/chat/completions", body)


# Stock SGLang's CPU kernels do not always sum in the same order (a prefix from the cache or not,
# another batch), so a greedy choice between two candidates this close can flip between two runs
# of stock SGLang itself; a wrong KV row moves logprobs by tenths of a nat or more (measured on
# the `small` model: top-2 gaps 0.0001-6 nats, most over 0.3).
TIE_NATS = 2e-3


def reply_text(resp: dict) -> str:
    """The assistant's text in a /v1/chat/completions response."""
    return resp["choices"][0]["message"]["content"]


def _steps(resp: dict) -> list[tuple[str, dict[str, float]]]:
    content = resp["choices"][0]["logprobs"]["content"]
    return [(e["token"], {c["token"]: c["logprob"] for c in e["top_logprobs"]}) for e in content]


def same_greedy(got: list[dict], want: list[dict], tie_nats: float = TIE_NATS) -> list[int]:
    """Asserts that each greedy response in `got` equals the one in `want` (responses to the same
    prompts, asked with `top_logprobs`), token for token, except where both first part at a
    near-tie: the token each chose is within `tie_nats` of the other's in BOTH runs' candidates,
    which float-summation order alone can flip. Returns the indices of such ties (the caller
    bounds how many it accepts); raises AssertionError naming the first real difference."""
    assert len(got) == len(want), (len(got), len(want))
    ties = []
    for i, (g, w) in enumerate(zip(got, want)):
        gs, ws = _steps(g), _steps(w)
        if [t for t, _ in gs] == [t for t, _ in ws]:
            continue
        k = next((j for j, (a, b) in enumerate(zip(gs, ws)) if a[0] != b[0]), None)
        text = (reply_text(g), reply_text(w))
        assert k is not None, f"request {i}: {len(gs)} tokens against {len(ws)}: {text}"
        (gt, gc), (wt, wc) = gs[k], ws[k]
        near = (gc[gt] - gc.get(wt, float("-inf")) <= tie_nats
                and wc[wt] - wc.get(gt, float("-inf")) <= tie_nats)
        assert near, (f"request {i}, token {k}: {gt!r} (candidates {gc}) where the reference "
                      f"chose {wt!r} (candidates {wc}); texts {text}")
        ties.append(i)
    return ties


def wait_for(predicate, timeout_s: float, what: str):
    """Poll another process's state until `predicate()` is truthy; returns its value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)  # polling an external process's state, not a synchronisation
    raise AssertionError(f"timed out waiting for {what}")


def metric(server: LocalServer, name: str) -> float:
    """Sum of a metric's samples on the server's Prometheus endpoint (0 when absent)."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))
