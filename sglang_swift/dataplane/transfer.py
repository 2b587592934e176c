"""The two-phase contract of a KV transfer (STYLE 3): its outcome and the handle that holds it.

`PoolTransferEngine` (pool_transfer.py) starts a copy and returns a `PoolTransferHandle`:
`wait()` completes it, `result()` peeks, `abort(reason)` abandons it. The caller keeps the
blocks locked (not evictable, not revocable by bookkeeping) until the handle is done.
`invalid()` says whether bytes the copy read may still be used (donor alive, lease epoch and
blocks unchanged since begin); the engine runs it after every layer's copy, and a consumer of a
copy whose completion the host did not see (a GPU stream) runs it once that completion is seen.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class TransferResult:
    """How a transfer ended: `failed_layers` are the layers not copied, `reason` why."""

    ok: bool
    failed_layers: tuple[int, ...]
    reason: str | None


class PoolTransferHandle:
    """A transfer in flight. A load carries its layer `counter` and the slot it armed there
    (`producer_id`, the index the batch consumes); `sync` is the lane's synchronize on a GPU,
    where the future only means the copy was enqueued."""

    def __init__(self, counter=None, producer_id: int | None = None, sync=None):
        self._future = None  # set by the engine once the copy is submitted
        self._sync = sync
        self.counter = counter
        self.producer_id = producer_id
        self._abort = threading.Event()
        self.layer_lock = threading.Lock()  # held while a layer copies; abort takes it
        self._invalid = None  # set by the engine at begin: () -> reason or None
        self.blocks: frozenset = frozenset()  # what it began under (set by the engine)
        self.epoch = None
        self.fence_generation = 0

    def invalid(self) -> str | None:
        """Why the bytes this transfer read may not be used now, or None: the donor is alive,
        the lease is the one (same epoch) it began under, its blocks were not fenced since, the
        read deadline has not passed and it was not aborted. A dead donor, a changed epoch, a
        fence and an abort are permanent, so None after the copy completed means none happened
        during the copy. Never blocks (host state only: a liveness probe, an epoch read, an int
        compare, one short lock only after a fence)."""
        return None if self._invalid is None else self._invalid()

    def wait(self, timeout_s: float | None = None) -> TransferResult:
        """The outcome once the copy finished (GPU: once the lane ran it); after `timeout_s`
        the transfer is aborted and reported failed with reason "timeout"."""
        try:
            result = self._future.result(timeout=timeout_s)
            if self._sync is not None:
                self._sync()
            return result
        except TimeoutError:
            self.abort("timeout waiting for the transfer")
            layers = self.counter.fail("timeout", self.producer_id) if self.counter else ()
            return TransferResult(False, layers, "timeout")

    def abort(self, reason: str) -> None:
        """Stop before the next layer and fail the layers not done; returns once no copy of
        this transfer runs (CPU) or is still queued on the GPU."""
        self._abort.set()  # first: the lane checks it under the lock before each layer
        with self.layer_lock:  # then wait out the layer being copied, if any
            pass
        if self.counter is not None:
            self.counter.fail(reason, self.producer_id)
        if self._sync is not None:
            self._sync()

    def result(self) -> TransferResult | None:
        """The outcome once the copy finished (None while it runs); GPU: once enqueued."""
        return self._future.result() if self._future.done() else None

    def done(self) -> bool:
        return self._future.done()
