"""Tensor parallelism with SwiftCache: the outcome is decided, and tested, at start-up.

Real SGLang CPU servers with `--tp 2` (SGLang's CPU engine runs one rank per core when
SGLANG_CPU_OMP_THREADS_BIND names a core per rank; it needs an explicit --max-total-tokens).
Invariants:
- what is not built with --tp > 1 (here: L3 storage below the host tier) is REFUSED: the
  server exits during start-up (it does not hang, and does not serve) and its log names --tp,
  the reason and the fix (`integration/host_tier.py`); lending and borrowing with --tp > 1,
  with a host tier too, are served (`tests/integration/test_tp_donation_e2e.py`);
- --tp 2 with --enable-swiftcache but without lending or borrowing is SUPPORTED: both ranks build
  the swiftcache tree without a runtime, and a two-turn chat gives exactly HF transformers'
  greedy output on the same weights (sharding changes no token).
"""

from __future__ import annotations

import os

import pytest
from integration.harness import LocalServer, ServerStartError, chat
from integration.test_server_e2e import hf_greedy

from benchmarks.workloads.sharegpt import load_conversations

pytestmark = pytest.mark.integration
TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank; without it SGLang refuses
POOL_TOKENS = 1024
STARTUP_S = 420  # two ranks on a loaded 2-core machine took up to 175 s to come up
MAX_TOKENS = 8


def _tp2_server(model, log_path, *extra: str) -> LocalServer:
    return LocalServer(model, swiftcache=True, max_total_tokens=POOL_TOKENS,
                       env={**os.environ, **TP_ENV}, log_path=log_path,
                       startup_timeout_s=STARTUP_S,
                       extra_args=["--tp", "2", "--dtype", "float32", *extra])


def test_tp_with_l3_storage_is_refused_at_startup(tiny_model, tmp_path):
    """--tp 2 with a host tier and --hicache-storage-backend file: start-up fails (the process
    exits, before any model loads) with the reason and the fix."""
    server = _tp2_server(tiny_model, tmp_path / "refused.log",
                         "--enable-hierarchical-cache", "--hicache-ratio", "2",
                         "--hicache-storage-backend", "file")
    with pytest.raises(ServerStartError) as err:
        with server:
            pass
    assert "server exited" in str(err.value), "refused by exiting, not by a start-up timeout"
    log = server.log_text()
    assert "does not support: --hicache-storage-backend file with --tp 2" in log, \
        server.log_tail()
    assert "drop --hicache-storage-backend or serve with --tp 1" in log  # the fix
    assert server.proc.poll() is not None


def test_tp_without_donation_serves_like_hf(tiny_model, tmp_path):
    """--tp 2 --enable-swiftcache alone serves: outputs equal HF greedy, both ranks run the tree."""
    conv = load_conversations(1, min_turns=2, max_chars_per_message=200)[0]
    messages: list[dict] = []
    outputs, expected = [], []
    with _tp2_server(tiny_model, tmp_path / "served.log", "--enable-cache-report") as server:
        for turn in conv.turns[:2]:
            messages.append({"role": "user", "content": turn.user})
            text = chat(server, messages, MAX_TOKENS)["choices"][0]["message"]["content"]
            outputs.append(text)
            expected.append(hf_greedy(tiny_model, messages, MAX_TOKENS))
            messages.append({"role": "assistant", "content": text})
        log = server.log_text()
    assert outputs == expected
    for rank in ("TP0", "TP1"):
        assert any(rank in line and "radix_ext tree" in line and "runtime off" in line
                   for line in log.splitlines()), f"rank {rank} did not build the swiftcache tree"
