"""Helpers for tests that start real SGLang servers on CPU.

    from integration.harness import LocalServer, tiny_model_dir
    with LocalServer(tiny_model_dir(), swiftcache=True, extra_args=["--enable-cache-report"]) as s:
        s.post("/generate", {...})

`LocalServer` binds 127.0.0.1 on a free port, waits for /health with a deadline, and kills the
server's whole process group on exit (see sglang_swift/local_server.py).
"""

from __future__ import annotations

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
