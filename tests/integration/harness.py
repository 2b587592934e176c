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

from sglang_swift.tools.local_server import LocalServer, ServerStartError, free_port  # noqa: F401



def tiny_model_dir() -> Path:
    """Build (once) and return the tiny Llama used by every integration test and the demo."""
    from sglang_swift.tools.tiny_model import DEFAULT_DIR, ensure_tiny_model

    return ensure_tiny_model(DEFAULT_DIR, seed=0)


def chat(server: LocalServer, messages: list[dict], max_tokens: int = 12) -> dict:
    """One greedy /v1/chat/completions call; returns the parsed JSON response."""
    return server.post("/v1/chat/completions", {
        "model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
    })


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
