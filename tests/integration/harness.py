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
    """One greedy /v1/chat/completions call; returns the parsed JSON response, with the output's
    token ids (`response_token_ids`, what `same_greedy` compares) and each generated token's
    `top_logprobs` candidates when asked."""
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True}
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


def output_ids(resp: dict) -> list[int]:
    """The generated token ids of a /v1/chat/completions response (asked with
    `return_token_ids`, as `chat` does) or of a /generate response."""
    if "choices" in resp:
        ids = resp["choices"][0].get("response_token_ids")
        assert ids is not None, "a chat response without response_token_ids: ask for them"
        return list(ids)
    return list(resp["output_ids"])


def _steps(resp: dict) -> list[tuple[object, dict[object, float]]]:
    """Per generated token, (the token, {candidate: logprob}): token strings for a chat
    response, token ids for a /generate one (asked with `top_logprobs_num`)."""
    if "choices" in resp:
        content = resp["choices"][0]["logprobs"]["content"]
        return [(e["token"], {c["token"]: c["logprob"] for c in e["top_logprobs"]})
                for e in content]
    meta = resp["meta_info"]
    return [(tok, {c[1]: c[0] for c in cands}) for (_, tok, _), cands
            in zip(meta["output_token_logprobs"], meta["output_top_logprobs"])]


def same_greedy(got: list[dict], want: list[dict], tie_nats: float = TIE_NATS) -> list[int]:
    """Asserts that each greedy response in `got` equals the one in `want` (responses to the same
    prompts, asked with top logprobs) in its token ids (`output_ids`), except where both first
    part at a near-tie: the token each chose is within `tie_nats` of the other's in BOTH runs'
    candidates, which float-summation order alone can flip. Two empty outputs are not a match
    (nothing was compared). Returns the indices of such ties (the caller bounds how many it
    accepts); raises AssertionError naming the first real difference."""
    assert len(got) == len(want), (len(got), len(want))
    assert got, "no responses to compare"
    ties = []
    for i, (g, w) in enumerate(zip(got, want)):
        gi, wi = output_ids(g), output_ids(w)
        assert gi or wi, f"request {i}: both outputs are empty, so nothing was compared"
        if gi == wi:
            continue
        gs, ws = _steps(g), _steps(w)
        k = next((j for j, (a, b) in enumerate(zip(gi, wi)) if a != b), None)
        text = (_text(g), _text(w))
        assert k is not None, f"request {i}: {len(gi)} tokens against {len(wi)}: {text}"
        assert k < len(gs) and k < len(ws), f"request {i}: no logprobs for token {k}: {text}"
        (gt, gc), (wt, wc) = gs[k], ws[k]
        # two ids that print alike (chat logprobs name tokens by text) cannot be told apart
        # by their candidates: a real difference
        near = (gt != wt and gc[gt] - gc.get(wt, float("-inf")) <= tie_nats
                and wc[wt] - wc.get(gt, float("-inf")) <= tie_nats)
        assert near, (f"request {i}, token {k}: id {gi[k]} {gt!r} (candidates {gc}) where the "
                      f"reference chose id {wi[k]} {wt!r} (candidates {wc}); texts {text}")
        ties.append(i)
    return ties


def _text(resp: dict) -> str:
    return reply_text(resp) if "choices" in resp else resp.get("text", "")


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
