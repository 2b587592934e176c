"""A request whose donor load failed goes back to SGLang's waiting queue (load_retry.py): released
through SGLang's retraction after its forward, out of the batches SGLang merges next, and queued
only once no pending result holds it; a chunked or many-times retracted request keeps its abort.

The requests are SGLang's own `Req`; the scheduler and batch record what SGLang's would be asked."""

from __future__ import annotations

from collections import deque
from http import HTTPStatus

import pytest

from sglang_swift.integration.load_retry import MAX_RETRIES, LoadRetries


def _req(rid: str):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", [1, 2, 3], SamplingParams(max_new_tokens=4))
    req.skip_radix_cache_insert = True  # as StreamingLoads._fail_request leaves it
    req.discard_output_reason = FINISH_ABORT("SwiftCache: loading failed (reclaimed)",
                                             HTTPStatus.SERVICE_UNAVAILABLE)
    return req


class Batch:
    """What LoadRetries uses of SGLang's ScheduleBatch: `release_req` retracts (SGLang's resets the
    request with `reset_for_retract` after freeing its row) and `filter_batch` drops requests."""

    def __init__(self, reqs):
        self.reqs = list(reqs)
        self.released = []

    def release_req(self, idx, remaing_req_count, offload_kv=True):
        assert remaing_req_count == 0 and offload_kv is False
        self.released.append(self.reqs[idx].rid)
        self.reqs[idx].reset_for_retract()
        return True

    def filter_batch(self, reqs_to_exclude=None):
        self.reqs = [r for r in self.reqs if r not in reqs_to_exclude]

    def copy(self):
        return Batch(self.reqs)


class Scheduler:
    def __init__(self, batch, chunked=None):
        self.last_batch = batch
        self.running_batch = Batch([])
        self.result_queue = deque()
        self.chunked_req = chunked
        self.queued = []

    def _add_request_to_queue(self, req, is_retracted=False):
        self.queued.append((req.rid, is_retracted))


def _stats():
    return {"loads_requeued": 0}


def test_a_failed_load_runs_again_once_its_result_was_processed():
    """Invariant: the request is released through SGLang's retraction right after the forward
    (output skipped: retracted, no discard reason left), leaves the batch SGLang merges next at
    once, and is queued only after no pending result holds it (the overlap loop's copy)."""
    ok, bad = _req("ok"), _req("bad")
    ok.discard_output_reason, ok.skip_radix_cache_insert = None, False
    batch = Batch([ok, bad])
    sched = Scheduler(batch)
    sched.result_queue.append((batch.copy(), None))  # overlap: processed after the next forward
    stats = _stats()
    retries = LoadRetries(stats)
    retries.take(sched, batch, [(bad, False)])
    assert batch.released == ["bad"] and bad.is_retracted and bad.discard_output_reason is None
    assert bad.skip_radix_cache_insert is False, "its next run inserts its KV like any request"
    assert stats["loads_requeued"] == 1 and retries.held() == 1
    retries.requeue(sched)
    assert [r.rid for r in batch.reqs] == ["ok"], "left the batch SGLang merges into running"
    assert sched.queued == [], "queued while a pending result still holds it"
    sched.result_queue.popleft()
    retries.requeue(sched)
    assert sched.queued == [("bad", True)] and retries.held() == 0
    retries.requeue(sched)
    assert sched.queued == [("bad", True)], "queued once"


@pytest.mark.parametrize("case", ["chunked", "retracted enough", "no scheduler", "not in batch"])
def test_a_load_that_cannot_run_again_keeps_its_abort(case):
    """Invariant: a chunked request mid-prefill, one already retracted MAX_RETRIES times, one
    whose load failed where no scheduler can queue it, or one not in the batch is not released:
    it finishes with the 503 StreamingLoads gave it."""
    bad = _req("bad")
    batch = Batch([bad] if case != "not in batch" else [])
    sched = Scheduler(batch, chunked=bad if case == "chunked" else None)
    if case == "retracted enough":
        bad.retraction_count = MAX_RETRIES
    stats = _stats()
    retries = LoadRetries(stats)
    retries.take(None if case == "no scheduler" else sched, batch, [(bad, False)])
    retries.requeue(sched)
    assert batch.released == [] and sched.queued == [] and stats["loads_requeued"] == 0
    assert bad.discard_output_reason.status_code == HTTPStatus.SERVICE_UNAVAILABLE
    assert bad.skip_radix_cache_insert and not bad.is_retracted
