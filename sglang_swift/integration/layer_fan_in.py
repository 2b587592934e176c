"""One prefill batch's layer-wise load from several copy engines, fanned in to the one layer
counter SGLang's KV pool waits on; and the wrapper that is registered with the pool.

A `PoolTransferEngine` serves one lease and signals a counter per layer (`update_producer`,
`complete`, `fail`, `aborted`, `failure_reason`). A batch may load from several leases, one
engine each, and attention on layer l may read the pool only once *every* engine is done with
layer l. `BatchLayerCounter` arms one slot of the pool's counter per batch (its `pid` is the
batch's `hicache_consumer_index`) and hands each engine a part of it: layer l of the slot is
completed once every part has finished or failed layer l, and never before `seal()` (all parts
added). Completing it hands the pool's counter the events the parts recorded after their copies
of layer l (device lanes); nothing here waits for them: the forward's stream waits for layer l's
events when attention reaches layer l (`LayerCounter.wait_until`), so on a GPU, where every part
is enqueued before the batch is sealed, layer 0 is read while later layers still copy. A part
that fails never releases a layer early for the others, so requests that loaded only from healthy
parts read complete KV; `failed_parts()` says which parts failed, so only the requests that used
them are dropped.

`TimedLayerCounter` is what the plugin registers with the KV pool and the tp worker: it
delegates to the real counter (`dataplane.make_layer_counter`), ends attention's waits for a
load at its batch's deadline (`watch`), and adds up how long attention waited for a layer
(the part of a load the forward did not hide), and when it first reached each layer of a load
(the timeline in docs/streaming.md).
"""

from __future__ import annotations

import threading
import time
from typing import Any

PENDING, READY, FAILED = 0, 1, 2


class BatchLayerCounter:
    """The per-batch fan-in; duck-typed as the counter `PoolTransferEngine.begin_load` takes."""

    def __init__(self, counter: Any, clock=time.perf_counter):
        self.counter = counter
        self.num_layers = counter.num_layers
        self.pid = counter.update_producer()  # raises if that ring slot is still loading
        self.clock = clock
        self.started_at = clock()
        self._lock = threading.Lock()
        self._state: list[list[int]] = []
        self._reason: list[str | None] = []
        self._events: list[list[Any]] = []
        self._released = [False] * self.num_layers
        self.released_at: list[float | None] = [None] * self.num_layers
        self._sealed = False

    # ---- what an engine calls --------------------------------------------------------------
    def update_producer(self) -> int:
        """A new part (one engine's transfer); returns its id."""
        with self._lock:
            if self._sealed:
                raise RuntimeError("a part was added to a sealed batch load")
            self._state.append([PENDING] * self.num_layers)
            self._reason.append(None)
            self._events.append([None] * self.num_layers)
            return len(self._state) - 1

    def complete(self, layer: int, producer_id: int | None = None, stream=None) -> None:
        """Part `producer_id` finished `layer` (GPU: enqueued on `stream`)."""
        with self._lock:
            part = self._part(producer_id)
            if self._state[part][layer] != PENDING:  # failed meanwhile: late news is ignored
                return
            self._state[part][layer] = READY
            if stream is not None:
                from ..dataplane import streams

                self._events[part][layer] = streams.record_event(stream)
            self._advance(layer)

    def fail(self, reason: str, producer_id: int | None = None) -> tuple[int, ...]:
        """Part `producer_id` stops: its layers not done fail; returns them."""
        with self._lock:
            part = self._part(producer_id)
            self._reason[part] = self._reason[part] or reason
            failed = tuple(i for i, s in enumerate(self._state[part]) if s != READY)
            for i in failed:
                self._state[part][i] = FAILED
                self._advance(i)
            return failed

    def aborted(self, producer_id: int | None = None) -> bool:
        """Whether the part should stop: it failed, or the consumer gave up on the batch (the
        pool's counter timed out waiting)."""
        with self._lock:
            if self._reason[self._part(producer_id)] is not None:
                return True
        return self.counter.aborted(self.pid)

    def failure_reason(self, producer_id: int | None = None) -> str | None:
        with self._lock:
            reason = self._reason[self._part(producer_id)]
        return reason or self.counter.failure_reason(self.pid)

    # ---- what the batch's owner calls --------------------------------------------------------
    def seal(self) -> None:
        """Every part is added: release the layers all parts are already done with."""
        with self._lock:
            self._sealed = True
            for layer in range(self.num_layers):
                self._advance(layer)

    def fail_part(self, reason: str) -> int:
        """Add a part that could not start (its donor is not readable): it counts as failed."""
        part = self.update_producer()
        self.fail(reason, part)
        return part

    def invalidate(self, reason: str, producer_id: int) -> None:
        """Part `producer_id`'s bytes may not be used (the check after its copy failed): its
        requests are dropped like those of a failed part, even if every layer was released."""
        with self._lock:
            self._reason[self._part(producer_id)] = reason

    def pending_parts(self) -> list[int]:
        """Parts with a layer neither done nor failed (a copy still running)."""
        with self._lock:
            return [p for p, s in enumerate(self._state) if PENDING in s]

    def failed_parts(self) -> dict[int, str]:
        """Part -> reason, for every part with a failed layer or that failed or was invalidated
        after its layers were released (stop the pending ones first).
        When the consumer gave up (the pool's counter failed a layer) every part counts: the
        forward went past that layer without knowing which copy was late."""
        consumer = self.counter.failure_reason(self.pid) if self.counter.failed_layers(
            self.pid) else None
        with self._lock:
            return {p: (self._reason[p] or consumer or "a layer was not copied")
                    for p, s in enumerate(self._state)
                    if consumer is not None or FAILED in s or self._reason[p] is not None}

    # ---- internals -------------------------------------------------------------------------
    def _part(self, producer_id: int | None) -> int:
        if producer_id is None or not 0 <= producer_id < len(self._state):
            raise ValueError(f"unknown part {producer_id} of a batch load with "
                             f"{len(self._state)} parts")
        return producer_id

    def _advance(self, layer: int) -> None:
        """Complete the pool counter's `layer` once every part is past it (lock held), handing
        it the parts' events for that layer: waited on by the consumer's stream, not here."""
        if not self._sealed or self._released[layer]:
            return
        if any(s[layer] == PENDING for s in self._state):
            return
        self._released[layer] = True
        self.released_at[layer] = self.clock()
        events = [e[layer] for e in self._events if e[layer] is not None]
        self.counter.complete(layer, self.pid, events=events)


class TimedLayerCounter:
    """The counter registered with SGLang (kv pool and tp worker): the real one, plus the time
    attention spent waiting in `wait_until` and when it first reached each layer of a load."""

    def __init__(self, counter: Any, clock=time.perf_counter):
        self.inner = counter
        self.clock = clock
        self.wait_s = 0.0
        self._reached: dict[int, list[float | None]] = {}
        self._deadline: dict[int, float] = {}  # ring slot -> when the forward stops waiting

    def __getattr__(self, name: str) -> Any:  # update_producer, complete, fail, reset, ...
        return getattr(self.inner, name)

    @property
    def consumer_index(self) -> int:
        return self.inner.consumer_index

    def set_consumer(self, index: int) -> None:
        self.inner.set_consumer(index)

    def wait_until(self, layer: int) -> bool:
        index = self.inner.consumer_index
        if index < 0:
            return True
        start = self.clock()
        reached = self._reached.get(index)
        if reached is not None and reached[layer] is None:
            reached[layer] = start
        deadline = self._deadline.get(index)
        if deadline is None:
            ok = self.inner.wait_until(layer)
        else:  # past the batch's deadline the layer fails at once (the slot's pending layers too)
            ok = self.inner.wait(layer, timeout_s=max(0.0, deadline - start)).ok
        self.wait_s += self.clock() - start
        return ok

    def watch(self, index: int, deadline: float | None = None) -> None:
        """Record when attention first reaches each layer of the load in ring slot `index`;
        attention waits for its layers until `deadline` (on `clock`) at the latest."""
        self._reached[index] = [None] * self.inner.num_layers
        if deadline is None:
            self._deadline.pop(index, None)
        else:
            self._deadline[index] = deadline

    def reached(self, index: int) -> list[float | None]:
        """When attention first asked for each layer of slot `index` (None: never); forgets it."""
        return self._reached.pop(index, [None] * self.inner.num_layers)
