"""The negative control of "outputs identical": one wrong KV row in donor memory changes the
tokens, for every layer of the borrower's model.

Real SGLang CPU servers: a donor on the tiny model lending half its pool, and a borrower on the
small model (8 layers, K and V rows) or on `tiny-mla` (4 layers, one latent row per token and
layer) whose pool holds one probe prompt or one filler prompt, not both, started
with the test-only fault `SWIFTCACHE_FAULT_DONOR_ROW` (`sglang_swift/integration/debug_seam.py`).
Each round asks a probe (computed from scratch), then a filler that evicts the probe into donor
memory, then the probe again (its prefix loaded back from the donor). For the probe of round L
the fault overwrites, right after the store, layer L's K and V row (the latent row) of the
probe's token ROW in the donor's bytes; one more probe is stored untouched. Invariants:
- the fault fired once per layer, changed bytes only in the row it names, and no other;
- each reloaded probe took its prefix, the corrupted row included, from the cache;
- the untouched probe's tokens after the reload equal its first answer (`same_greedy`: token
  ids, but for a float near-tie): the reload itself changes nothing;
- each corrupted probe's tokens differ from its first answer beyond a near-tie: a wrong row in
  any one layer is caught by comparing token ids. With the fault a no-op (no bytes changed, or
  outputs equal) this test fails.
"""

from __future__ import annotations

import json
import os
import random

import pytest
from integration.harness import LocalServer, output_ids, same_greedy

from benchmarks.tools.demo import wait_for_lease
from benchmarks.tools.local_server import start_all
from benchmarks.tools.tiny_model import MLA_SERVER_ARGS, MODEL_SHAPES, ensure_tiny_model
from sglang_swift.integration.debug_seam import FAULT_ENV

pytestmark = pytest.mark.integration
# the borrower's model, what SGLang's CPU engine serves it with (tiny_model.py), and the tokens
# each probe generates: a wrong row changed the small model's answer by token 21 at the latest,
# tiny-mla's by token 4 (its interpreted Triton kernels make each decode step slow)
BORROWERS = {"small": ((), 32), "mla": (MLA_SERVER_ARGS, 12)}
POOL = 256  # the borrower's device pool: a filler (231 tokens) leaves no room for a probe
PROBE, FILLER = 48, 230
ROW = 20  # the probe token whose row the fault overwrites
TOP = 5  # candidates per token, for the near-tie test
CONTROL_FIRST = 1950  # the untouched probe's first token id (no fault target)


def _args(rendezvous: str, role: str, *extra: str) -> list[str]:
    return ["--enable-cache-report", "--dtype", "float32", "--swiftcache-role", role,
            "--swiftcache-rendezvous-dir", rendezvous, "--swiftcache-heartbeat-timeout-s", "3",
            "--swiftcache-heartbeat-interval-s", "0.3", *extra]


def _generate(server: LocalServer, ids: list[int], new_tokens: int) -> dict:
    return server.post("/generate", {
        "input_ids": ids, "return_logprob": True, "top_logprobs_num": TOP,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens,
                            "ignore_eos": True}})


def _prompt(rng: random.Random, first: int, n: int) -> list[int]:
    """`n` token ids starting with `first`; the rest below 1800, so no two prompts share a
    first token (each is its own node in the tree, and its own store)."""
    return [first] + [rng.randrange(10, 1800) for _ in range(n - 1)]


@pytest.mark.parametrize("shape", sorted(BORROWERS))
def test_one_wrong_donor_row_in_any_layer_changes_the_tokens(shape, tiny_model, tmp_path):
    borrower_model = ensure_tiny_model(shape=shape)
    server_args, new_tokens = BORROWERS[shape]
    rng = random.Random(0)
    targets = {1900 + layer: layer for layer in range(MODEL_SHAPES[shape]["num_hidden_layers"])}
    report = tmp_path / "fault.jsonl"
    fault = {"targets": [[tok, layer] for tok, layer in targets.items()], "row": ROW,
             "report": str(report)}
    rendezvous = str(tmp_path / "rv")
    donor = LocalServer(tiny_model, max_total_tokens=4096, log_path=tmp_path / "donor.log",
                        extra_args=_args(rendezvous, "donor", "--swiftcache-lend-fraction",
                                         "0.5"))
    borrower = LocalServer(borrower_model, max_total_tokens=POOL, log_path=tmp_path / "b.log",
                           env={**os.environ, FAULT_ENV: json.dumps(fault)},
                           extra_args=_args(rendezvous, "borrower", *server_args,
                                            "--swiftcache-max-borrow-blocks", "1500"))
    try:
        start_all([donor, borrower])
        wait_for_lease(rendezvous, timeout_s=90)
        firsts, reloads = {}, {}
        for n, first in enumerate([CONTROL_FIRST, *targets]):
            probe = _prompt(rng, first, PROBE)
            firsts[first] = _generate(borrower, probe, new_tokens)
            _generate(borrower, _prompt(rng, 1800 + n, FILLER), 1)  # evicts the probe
            reloads[first] = _generate(borrower, probe, new_tokens)
    finally:
        borrower.stop()
        donor.stop()

    fired = [json.loads(line) for line in report.read_text().splitlines()] \
        if report.exists() else []
    assert sorted(f["first_token"] for f in fired) == sorted(targets), (fired,
                                                                         borrower.log_tail())
    for f in fired:
        assert "error" not in f, f
        assert 0 < f["changed_bytes"] <= f["row_bytes"], f
        assert f["changed_elsewhere_bytes"] == 0, f
    for first, resp in reloads.items():
        assert resp["meta_info"]["cached_tokens"] > ROW, (first, resp["meta_info"])
    assert same_greedy([reloads[CONTROL_FIRST]], [firsts[CONTROL_FIRST]]) in ([], [0])
    missed, caught = [], {}
    for first, layer in targets.items():
        try:
            same_greedy([reloads[first]], [firsts[first]])
        except AssertionError:  # a real difference: the wrong row was caught
            got, want = output_ids(reloads[first]), output_ids(firsts[first])
            caught[layer] = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
            continue
        missed.append(layer)
    print(f"layer: first generated token changed by its wrong row {caught}")
    assert not missed, f"a wrong row in layer(s) {missed} left the tokens unchanged"
