"""Per-layer completion of a layer-wise load: what SGLang's KV pool waits on before attention
reads layer l.

Duck-type compatible with SGLang 0.5.23's LayerDoneCounter (`num_layers`, `consumer_index`,
`set_consumer`, `update_producer`, `wait_until`, `reset`), so it can be registered with
`kvcache.register_layer_transfer_counter(counter)`; SGLang calls `wait_until(layer)` from
get_key_buffer / get_value_buffer (twice per layer) and ignores what it returns.

Like SGLang's, it is a ring of `num_counters` slots so the next batch's load can be produced
while the current one is consumed. Each slot holds one state per layer: PENDING, READY or FAILED.

One protocol on every device. READY means the layer is in place *for the host's purposes*: on a
CPU lane the loader thread finished copying it; on a device lane (a GPU, or the emulated device
on CPU) its copy is enqueued and an event recorded after it. A layer carries the events its
copies recorded (none on a CPU lane). `wait_until(layer)` blocks the host until the layer is
READY (on a device lane it already is: the loader enqueues up front) and then makes the *current
stream* (the one the forward runs on) wait for exactly that layer's events, device side: the
forward's layer l never waits for a later layer's copy.

Abort and timeout: `fail(reason)` (the loader saw the donor vanish) marks every layer that is
not READY as FAILED and wakes all waiters; a wait that outlives `timeout_s` does the same with
reason "timeout". `wait_until` then returns False at once instead of raising: an exception inside
attention would kill the server, so the caller learns the failed layers from `failed_layers()` /
`wait()` and discards the batch's output (falls back to recompute).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

PENDING, READY, FAILED = 0, 1, 2


@dataclass(frozen=True)
class LayerWaitResult:
    ok: bool
    layer: int
    failed_layers: tuple[int, ...]
    reason: str | None


class _Slot:
    def __init__(self, num_layers: int):
        self.state = [READY] * num_layers  # an unused slot waits on nothing
        self.reason: str | None = None
        self.events: list[list] = [[] for _ in range(num_layers)]

    def arm(self) -> None:
        self.state = [PENDING] * len(self.state)
        self.reason = None
        self.events = [[] for _ in self.state]

    def failed(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.state) if s == FAILED)

    def in_flight(self) -> bool:
        return PENDING in self.state


class LayerCounter:
    """Per-layer completion of a ring of loads (see the module docstring)."""

    def __init__(self, num_layers: int, timeout_s: float = 30.0, num_counters: int = 3):
        if num_layers <= 0 or num_counters <= 0 or timeout_s <= 0:
            raise ValueError("num_layers, num_counters and timeout_s must be positive")
        self.num_layers = num_layers
        self.num_counters = num_counters
        self.timeout_s = timeout_s
        self.producer_index = -1
        self.consumer_index = -1
        self._slots = [_Slot(num_layers) for _ in range(num_counters)]
        self._cond = threading.Condition()

    # ---- SGLang's interface ----------------------------------------------------------------
    def update_producer(self) -> int:
        """Arm the next slot for a new load and return its index (the batch's consumer index).
        Raises RuntimeError if that slot's previous load is still in flight."""
        with self._cond:
            nxt = (self.producer_index + 1) % self.num_counters
            if self._slots[nxt].in_flight():
                raise RuntimeError(
                    f"layer counter slot {nxt} is still loading; more than "
                    f"{self.num_counters} loads in flight"
                )
            self._slots[nxt].arm()
            self.producer_index = nxt
            return nxt

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, layer: int) -> bool:
        """Block until `layer` of the consumer's load is usable; False if it failed."""
        if self.consumer_index < 0:
            return True
        return self.wait(layer).ok

    def reset(self) -> None:
        with self._cond:
            self.producer_index = -1
            self.consumer_index = -1
            self._slots = [_Slot(self.num_layers) for _ in range(self.num_counters)]
            self._cond.notify_all()

    # ---- producer side ---------------------------------------------------------------------
    def complete(self, layer: int, producer_id: int | None = None, stream=None,
                 events=()) -> None:
        """The loader finished `layer`. On a device lane it enqueued it: with `stream` (the
        copy stream) an event is recorded there now; `events` are events already recorded
        after the layer's copies (a batch fanned in from several lanes). The consumer's stream
        waits for all of them when it reaches the layer, and for nothing else."""
        with self._cond:
            slot = self._slots[self._pid(producer_id)]
            if slot.state[layer] == FAILED:  # the load was abandoned; late news is ignored
                return
            marks = list(events)
            if stream is not None:
                from . import streams

                marks.append(streams.record_event(stream))
            slot.events[layer] = marks
            slot.state[layer] = READY
            self._cond.notify_all()

    def fail(self, reason: str, producer_id: int | None = None) -> tuple[int, ...]:
        """Abort a load: every layer not yet READY becomes FAILED; waiters return at once."""
        with self._cond:
            slot = self._slots[self._pid(producer_id)]
            self._fail_locked(slot, reason)
            return slot.failed()

    # ---- explicit waits and queries --------------------------------------------------------
    def wait(
        self, layer: int, timeout_s: float | None = None, consumer_id: int | None = None
    ) -> LayerWaitResult:
        idx = self.consumer_index if consumer_id is None else consumer_id
        if idx < 0:
            return LayerWaitResult(True, layer, (), None)
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        with self._cond:
            slot = self._slots[idx]
            while slot.state[layer] == PENDING:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail_locked(slot, f"timeout: layer {layer} not ready after {limit}s")
                    break
                self._cond.wait(left)
            if slot.state[layer] == FAILED:
                return LayerWaitResult(False, layer, slot.failed(), slot.reason)
            events = slot.events[layer]
        self._device_wait(events)
        return LayerWaitResult(True, layer, (), None)

    def aborted(self, producer_id: int | None = None) -> bool:
        """True once the load in this slot failed or timed out: the loader stops copying, since
        the consumer may already have given the destination slots to someone else."""
        with self._cond:
            return self._slots[self._pid(producer_id)].reason is not None

    def failed_layers(self, index: int | None = None) -> tuple[int, ...]:
        with self._cond:
            return self._slots[self.consumer_index if index is None else index].failed()

    def failure_reason(self, index: int | None = None) -> str | None:
        with self._cond:
            return self._slots[self.consumer_index if index is None else index].reason

    # ---- internals -------------------------------------------------------------------------
    def _pid(self, producer_id: int | None) -> int:
        idx = self.producer_index if producer_id is None else producer_id
        if idx < 0:
            raise RuntimeError("no load is armed: call update_producer() first")
        return idx

    def _fail_locked(self, slot: _Slot, reason: str) -> None:
        for i, s in enumerate(slot.state):
            if s == PENDING:
                slot.state[i] = FAILED
        slot.reason = slot.reason or reason
        self._cond.notify_all()

    def _device_wait(self, events) -> None:
        """Order the current stream after the layer's copies, device side (no events: a CPU
        lane's layer is in place once READY)."""
        if events:
            from . import streams

            streams.wait_events(None, events)


CpuLayerCounter = LayerCounter  # names the deployments knew: one class serves every lane
CudaLayerCounter = LayerCounter
