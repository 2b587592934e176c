"""Donor hits streamed under the forward, in live servers (integration/streaming.py).

A donor SGLang server lends pages of its own pool; a borrower whose pool is too small for the
prompts demotes a shared prefix into them, then serves a request on that prefix from the donor.
Stock SGLang with the borrower's pool, given the same request sequence, is the reference.
Invariants:
- the donor-tier hit is answered token-identical to stock SGLang, its KV was loaded by a copy
  started with its batch (`swiftcache_loads_started_total`), and the borrower's scheduler thread
  never waited on a load copy (`swiftcache_load_wait_seconds_total` stays 0: a counter the
  runtime keeps, not a timing);
- a donor that dies between `match_prefix` and the forward (the borrower is held right before
  it starts the batch's loads, the donor is SIGKILLed and found dead by the borrower's agent,
  then it goes on: the load's copy fails) never produces wrong tokens and never fails the
  request: the failed load sends its request back to the waiting queue
  (`swiftcache_loads_requeued_total` = `swiftcache_loads_failed_total` >= 1), where it is
  recomputed and answered as stock; the same request then comes back recomputed,
  token-identical, and the server keeps serving.

The hold is a `sitecustomize` on the borrower's PYTHONPATH (test-only: production code has no
hook for it) that wraps `StreamingLoads.start` once a file says so.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error

import pytest
from integration.harness import LocalServer, metric, wait_for

from benchmarks.tools.demo import ctl, wait_for_lease
from benchmarks.tools.local_server import serving

pytestmark = pytest.mark.integration
SMALL_POOL = 450
MAX_TOKENS = 8
HOLD = '''
import importlib.abc, importlib.util, os, sys, time

_DIR = os.environ["SWIFT_TEST_HOLD_DIR"]


def _wrap(cls):
    start = cls.start

    def held_start(self, batch):
        armed = os.path.join(_DIR, "armed")
        if self._queued and os.path.exists(armed):
            os.remove(armed)
            open(os.path.join(_DIR, "queued"), "w").close()
            while not os.path.exists(os.path.join(_DIR, "go")):
                time.sleep(0.05)
        return start(self, batch)

    cls.start = held_start


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "sglang_swift.integration.streaming":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _wrap(module.StreamingLoads)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


def _words(seed: int, n: int) -> str:
    """A deterministic prompt of about `n` words, different per seed."""
    return " ".join(f"item{(seed * 7919 + i * 104729) % 9973}" for i in range(n))


PREFIX = "Remember this list: " + _words(1, 45)  # about 210 tokens
FILLERS = ["Another list: " + _words(s, 45) for s in (2, 3, 4)]  # 3 x 200 > the pool
FIRST, SECOND = PREFIX + " Question one?", PREFIX + " Question two, longer?"


def _generate(server, text: str) -> dict:
    return server.post("/generate", {"text": text, "sampling_params": {
        "max_new_tokens": MAX_TOKENS, "temperature": 0.0}})






def _args(rendezvous: str, role: str, *extra: str) -> list[str]:
    return ["--enable-cache-report", "--dtype", "float32", "--swiftcache-role", role,
            "--swiftcache-rendezvous-dir", rendezvous, "--swiftcache-heartbeat-timeout-s", "3",
            "--swiftcache-heartbeat-interval-s", "0.3", *extra]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    """Stock SGLang's answers to the same sequence, with the borrower's pool."""
    log = tmp_path_factory.mktemp("stock") / "stock.log"
    with LocalServer(tiny_model, swiftcache=False, max_total_tokens=SMALL_POOL, log_path=log,
                     extra_args=["--enable-cache-report", "--dtype", "float32"]) as stock:
        _generate(stock, FIRST)
        for text in FILLERS:
            _generate(stock, text)
        return _generate(stock, SECOND)["text"]


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    """A donor and a borrower that holds a lease of its pool, with the hold installed."""
    tmp = tmp_path_factory.mktemp("streaming")
    hold_dir = tmp / "hold"
    hold_dir.mkdir()
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(HOLD)
    env = dict(os.environ, SWIFT_TEST_HOLD_DIR=str(hold_dir),
               PYTHONPATH=os.pathsep.join([str(tmp / "site"), os.environ.get("PYTHONPATH", "")]))
    rendezvous = str(tmp / "rv")
    donor = LocalServer(tiny_model, max_total_tokens=4096, log_path=tmp / "donor.log",
                        extra_args=_args(rendezvous, "donor", "--swiftcache-lend-fraction", "0.5"))
    borrower = LocalServer(tiny_model, max_total_tokens=SMALL_POOL, log_path=tmp / "b.log",
                           env=env, extra_args=_args(rendezvous, "borrower", "--enable-metrics",
                                                     "--swiftcache-max-borrow-blocks", "1500"))
    with serving(donor, borrower):
        agents = wait_for_lease(rendezvous, timeout_s=90)
        assert agents[0]["leases"], agents
        yield donor, borrower, hold_dir


def _demote_prefix(borrower) -> None:
    """Compute the shared prefix, then push it out of the borrower's pool into the donor."""
    _generate(borrower, FIRST)
    for text in FILLERS:
        _generate(borrower, text)


def test_donor_hit_is_token_identical_and_the_scheduler_never_waited_on_the_copy(pair,
                                                                                  reference):
    """Invariant: see the module docstring (first point)."""
    _, borrower, _ = pair
    _demote_prefix(borrower)
    started = wait_for(lambda: metric(borrower, "swiftcache_stores_started_total"), 30,
                    "demotion stores on the borrower's /metrics")
    assert started > 0
    loads_before = metric(borrower, "swiftcache_loads_started_total")
    out = _generate(borrower, SECOND)
    assert out["text"] == reference
    loads = wait_for(lambda: metric(borrower, "swiftcache_loads_started_total") - loads_before, 30,
                  "a streamed load on the borrower's /metrics")
    assert loads >= 1 and out["meta_info"]["cached_tokens"] > 0, out["meta_info"]
    assert metric(borrower, "swiftcache_loaded_tokens_total") > 0
    assert metric(borrower, "swiftcache_loads_failed_total") == 0
    assert metric(borrower, "swiftcache_load_wait_seconds_total") == 0


def test_donor_killed_between_match_and_forward_never_yields_wrong_tokens(pair, reference):
    """Invariant: see the module docstring (second point)."""
    donor, borrower, hold_dir = pair
    _demote_prefix(borrower)
    (hold_dir / "armed").touch()
    result: dict = {}

    def send():
        try:
            result["out"] = _generate(borrower, SECOND)
        except urllib.error.HTTPError as exc:
            result["error"] = (exc.code, exc.read().decode(errors="replace"))

    sender = threading.Thread(target=send)
    sender.start()
    wait_for(lambda: (hold_dir / "queued").exists(), 60, "the borrower to queue the donor load")
    os.killpg(donor.proc.pid, 9)  # SIGKILL the donor server, scheduler included
    donor.proc.wait(30)
    # the borrower's agent (its own thread, the scheduler is held) declares the donor dead, so
    # the queued load's copy fails rather than reading the dead donor's still-mapped pages
    rendezvous = str(hold_dir.parent / "rv")
    wait_for(lambda: _donor_gone_for_borrower(rendezvous), 60,
             "the borrower's agent to find the donor dead")
    (hold_dir / "go").touch()
    sender.join(120)
    assert not sender.is_alive(), "the request never finished"
    assert "error" not in result, f"the request failed: {result.get('error')}"
    finish = result["out"]["meta_info"].get("finish_reason") or {}
    assert finish.get("type") != "abort", finish
    assert result["out"]["text"] == reference, "wrong tokens after the donor died"
    assert _generate(borrower, SECOND)["text"] == reference  # recomputed from now on
    assert borrower.proc.poll() is None, borrower.log_tail()
    failed = metric(borrower, "swiftcache_loads_failed_total")
    requeued = metric(borrower, "swiftcache_loads_requeued_total")
    assert failed >= 1 and requeued == failed, (requeued, failed)
    print(json.dumps({"loads_failed": failed, "loads_requeued": requeued}))


def _donor_gone_for_borrower(rendezvous: str) -> bool:
    """Whether the one agent still answering `ctl status` (the borrower's) has no peer left."""
    alive = [a for a in json.loads(ctl(rendezvous, json_out=True)) if "peers" in a]
    return len(alive) == 1 and not alive[0]["peers"]
