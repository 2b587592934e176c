"""A request whose lower-tier load failed runs again instead of failing.

A load from donor memory can fail through no fault of the request: the donor took its pages back
while the copy ran (a reclaim fences them at once, `runtime._fence_reclaim`), the donor died, or
the batch's read deadline passed. The forward that read the missing layers has run and its output
is dropped either way (`streaming.StreamingLoads._fail_request`). SGLang's answer to a failed
external load is to finish the request with 503; here the request goes back to SGLang's waiting
queue the way SGLang itself retracts a decode request under memory pressure
(`ScheduleBatch.release_req`: its KV row is freed without entering the tree, its prefix match and
lock are reset), so it is matched again against the tree as it is then, where the reclaimed
prefix has fallen to the host tier or is gone and is recomputed. The client sees a later first
token, never an error and never tokens from unloaded KV.

It takes two scheduler steps, because SGLang may still process the failed batch's result after
the next batch is built (the overlap loop keeps a copy of it in `result_queue`):

1. after the forward (`take`, from the BATCH_RAN hook): the request's KV is released and it is
   marked retracted, so SGLang's result processing skips its output;
2. before the next batch is chosen (`requeue`, from the SCHEDULER_STEP hook): the request leaves
   `last_batch` and `running_batch` before SGLang merges them, and once no pending result holds
   it, it re-enters the waiting queue (`Scheduler._add_request_to_queue`).

The abort stays (the client gets 503 with the reason) for a chunked request mid-prefill, whose
earlier chunks' KV SGLang keeps in its own pending slot, and for a request already retracted
MAX_RETRIES times, so a load that keeps failing cannot loop.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

logger = logging.getLogger(__name__)

MAX_RETRIES = 2  # SGLang's retraction count of a request past which a failed load aborts it


class LoadRetries:
    """Requests whose load failed, between their release (`take`) and their return to SGLang's
    waiting queue (`requeue`). `stats["loads_requeued"]` counts the failed loads whose request
    ran again (the rest of `loads_failed` were aborted)."""

    def __init__(self, stats: dict):
        self.stats = stats
        self._held: list = []  # retracted, not yet back in the waiting queue

    def take(self, scheduler: Any, batch: Any, failed: Iterable[tuple[Any, bool]]) -> None:
        """`failed`: (request, its skip_radix_cache_insert before the failure) of `batch`'s
        requests whose load failed, each already marked to abort. Each that may run again is
        released through SGLang's retraction and held for `requeue`; the others keep the
        abort."""
        reqs = list(getattr(batch, "reqs", None) or [])
        for req, skip_insert in failed:
            index = next((i for i, r in enumerate(reqs) if r is req), None)
            if index is None or not self._may_retry(scheduler, req):
                continue
            reason = req.discard_output_reason
            req.discard_output_reason = None
            batch.release_req(index, 0, offload_kv=False)  # touchpoints.RETRY_RELEASE
            req.skip_radix_cache_insert = skip_insert
            self._held.append(req)
            self.stats["loads_requeued"] += 1
            logger.info("SwiftCache: request %s goes back to the queue: %s", req.rid,
                        getattr(reason, "message", reason))

    def requeue(self, scheduler: Any) -> None:
        """Before SGLang picks the next batch: the held requests leave the batches SGLang is
        about to merge, and those no pending result holds re-enter the waiting queue."""
        if not self._held:
            return
        held = {id(r) for r in self._held}
        for name in ("last_batch", "running_batch"):  # touchpoints.RETRY_REQUEUE
            batch = getattr(scheduler, name, None)
            if batch is not None and any(id(r) in held for r in batch.reqs):
                batch.filter_batch(reqs_to_exclude=[r for r in batch.reqs if id(r) in held])
        pending = {id(r) for queued, _ in getattr(scheduler, "result_queue", None) or ()
                   for r in queued.reqs}
        ready = [r for r in self._held if id(r) not in pending]
        self._held = [r for r in self._held if id(r) in pending]
        for req in ready:
            scheduler._add_request_to_queue(req, is_retracted=True)

    def held(self) -> int:
        return len(self._held)

    @staticmethod
    def _may_retry(scheduler: Any, req: Any) -> bool:
        """Whether `req` may run again: there is a scheduler to queue it (a load that failed
        before its batch was built has none), it is not mid chunked prefill, and it was retracted
        fewer than MAX_RETRIES times."""
        if not callable(getattr(scheduler, "_add_request_to_queue", None)):
            return False
        return (scheduler.chunked_req is not req and req.inflight_middle_chunks <= 0
                and not req.finished() and req.retraction_count < MAX_RETRIES)
