"""Donated memory in live servers: a donor SGLang server lends KV blocks to a borrower server.

Three real SGLang CPU servers on the tiny model: a donor (`--swiftcache-role donor`), a borrower
with a KV pool too small for the conversations (`--swiftcache-role borrower`), and stock SGLang with
the same small pool as the reference. Invariants:
- the two SwiftCache servers find each other and agree on a lease (ctl status shows it);
- the borrower's greedy outputs equal stock SGLang's, turn by turn: donated memory never changes
  a token;
- prefixes evicted from the borrower's pool come back from the donor: the borrower reports more
  cached tokens than stock SGLang with the same pool;
- after the donor is killed with SIGKILL, the borrower keeps serving, still token-identical.
"""

from __future__ import annotations

import os
import time

import pytest

from integration.harness import LocalServer, chat
from sglang_swift.tools.demo import wait_for_lease
from sglang_swift.workloads.sharegpt import load_conversations

pytestmark = pytest.mark.integration
SMALL_POOL = 450  # tokens: five conversations' histories do not fit, so the tree must evict
MAX_TOKENS = 8


def _args(rendezvous: str, role: str, *extra: str) -> list[str]:
    return ["--enable-cache-report", "--dtype", "float32", "--swiftcache-role", role,
            "--swiftcache-rendezvous-dir", rendezvous,
            # a loaded 2-core CI machine can starve the agent thread for a second or more
            "--swiftcache-heartbeat-timeout-s", "3", "--swiftcache-heartbeat-interval-s", "0.3",
            *extra]


def _replay(server, convs, turns) -> tuple[list[str], list[int]]:
    """Interleave conversations turn by turn, so each one's prefix is evicted before it returns."""
    histories = [[] for _ in convs]
    texts, cached = [], []
    for t in range(turns):
        for conv, msgs in zip(convs, histories):
            if t >= len(conv.turns):
                continue
            msgs.append({"role": "user", "content": conv.turns[t].user})
            resp = chat(server, msgs, MAX_TOKENS)
            text = resp["choices"][0]["message"]["content"]
            texts.append(text)
            cached.append((resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            msgs.append({"role": "assistant", "content": text})
    return texts, cached


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)  # polling an external process's state, not a synchronisation
    raise AssertionError(f"timed out waiting for {what}")


def test_borrower_uses_donor_memory_and_survives_donor_death(tiny_model, tmp_path):
    rendezvous = str(tmp_path / "rv")
    convs = load_conversations(5, min_turns=4, max_chars_per_message=200)
    with LocalServer(tiny_model, swiftcache=False, max_total_tokens=SMALL_POOL,
                     extra_args=["--enable-cache-report", "--dtype", "float32"],
                     log_path=tmp_path / "stock.log") as stock:
        ref_texts, ref_cached = _replay(stock, convs, 3)
        ref_tail, _ = _replay(stock, convs[:2], 4)

    donor = LocalServer(tiny_model, max_total_tokens=4096, log_path=tmp_path / "donor.log",
                        extra_args=_args(rendezvous, "donor", "--swiftcache-lend-fraction", "0.5"))
    borrower = LocalServer(tiny_model, max_total_tokens=SMALL_POOL, log_path=tmp_path / "b.log",
                           extra_args=_args(rendezvous, "borrower", "--enable-metrics",
                                        "--swiftcache-max-borrow-blocks", "1500"))
    with donor, borrower:
        agents = wait_for_lease(rendezvous, timeout_s=90)  # through `ctl status`
        assert agents[0]["leases"], agents
        texts, cached = _replay(borrower, convs, 3)
        assert texts == ref_texts
        assert sum(cached) > sum(ref_cached), (cached, ref_cached)
        loaded = _wait(lambda: _metric(borrower, "swiftcache_loaded_tokens_total"), 30,
                       "swiftcache metrics on the borrower's /metrics")
        assert loaded > 0

        donor_pid = donor.proc.pid
        os.killpg(donor_pid, 9)  # SIGKILL the donor server, scheduler included
        donor.proc.wait(30)
        tail, _ = _replay(borrower, convs[:2], 4)
        assert tail == ref_tail
        _wait(lambda: "lost (" in borrower.log_text(), 30, "the borrower to detect the lost donor")
        tail, _ = _replay(borrower, convs[:2], 4)  # and again, with the donor tier gone
        assert tail == ref_tail
        assert borrower.proc.poll() is None, borrower.log_tail()
    leaked = [f for f in os.listdir("/dev/shm") if f.startswith("swift_")
              and any(f.startswith(f"swift_{pid}_") for pid in _pids_in(tmp_path / "donor.log"))]
    assert not leaked, f"donor arenas left in /dev/shm: {leaked}"


def _metric(server, name: str) -> float:
    """Sum of a metric's samples on the server's Prometheus endpoint (0 when absent)."""
    import urllib.request

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _pids_in(log_path) -> set[int]:
    """Scheduler pids a server log names (the donor's arena carries its scheduler's pid)."""
    import re

    return {int(m) for m in re.findall(r"in pid (\d+) with", log_path.read_text())}
