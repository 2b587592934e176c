"""The transfer engine: store a finished prefix into donor blocks, load it back layer by layer.

Two-phase (STYLE 3): `begin_store` / `begin_load` validate everything and start the copy, and
return a handle; `handle.wait()` completes it and `handle.abort(reason)` abandons it. The caller
keeps the blocks locked (not evictable, not revocable by bookkeeping) until the handle is done.

A load completes layers in order and tells the layer counter after each one, so attention on
layer l can start while layer l+1 is still in flight. Before each layer the loader asks
`liveness()`; when the donor is gone it fails the remaining layers instead of copying.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

import swift_kernels as sk
from swift_kernels import KVGeometry
from swift_kernels import kv_layout as lay

from .block_size import unused_bytes
from .streams import make_lane


@dataclass(frozen=True)
class TransferResult:
    ok: bool
    failed_layers: tuple[int, ...]
    reason: str | None


class TransferHandle:
    def __init__(self, future, counter=None, producer_id: int | None = None, sync=None):
        self._future = future
        self._sync = sync  # GPU: the copy stream's synchronize; the future only means enqueued
        self.counter = counter
        self.producer_id = producer_id
        self._abort = threading.Event()

    def wait(self, timeout_s: float | None = None) -> TransferResult:
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
        """Stop before the next layer; layers not yet done are reported failed."""
        self._abort.set()
        if self.counter is not None:
            self.counter.fail(reason, self.producer_id)

    def done(self) -> bool:
        return self._future.done()


class TransferEngine:
    """Moves KV between one model's local pool and one arena (local or mapped)."""

    def __init__(
        self,
        arena_memory: torch.Tensor,
        geometry: KVGeometry,
        *,
        backend: str = "auto",
        liveness: Callable[[], bool] | None = None,
        device=None,
        cpu_threads: int = 1,
        tuning: dict | None = None,
    ):
        unused_bytes(geometry, arena_memory.shape[1])  # raises if a page does not fit a block
        self.arena = arena_memory
        self.geometry = geometry
        self.device = torch.device(device) if device is not None else arena_memory.device
        self.backend = sk.resolve_backend(backend, self.device)
        self.liveness = liveness or (lambda: True)
        self.lane = make_lane(self.device, cpu_threads)
        self.tuning = tuning  # Triton launch parameters (kv_triton.DEFAULT_TUNING when None)

    def close(self) -> None:
        self.lane.close()

    def _check(self, k_buffers, v_buffers, slots, blocks):
        """Validate the whole transfer once (kv_layout.check_transfer); the per-layer calls then
        skip every check. `slots` are local token slots, `blocks` arena block ids."""
        g = self.geometry
        if k_buffers and k_buffers[0].device != self.device:
            raise ValueError(
                f"local buffers on {k_buffers[0].device} differ from the engine's {self.device}"
            )
        slots = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        blocks = torch.as_tensor(blocks, dtype=torch.int64, device=self.device)
        lay.check_transfer(self.arena, g, k_buffers, v_buffers, slots, blocks)
        plan = sk.plan_rows(slots, blocks, g.page_size) if self.backend == "vectorized" else None
        return slots, blocks, plan

    def begin_store(self, k_buffers, v_buffers, slots, blocks) -> TransferHandle:
        """Gather tokens `slots` of every layer into `blocks` (one page per block)."""
        slots, blocks, plan = self._check(k_buffers, v_buffers, slots, blocks)
        handle: TransferHandle

        def job():
            for layer in range(self.geometry.num_layers):
                if handle._abort.is_set():
                    return TransferResult(
                        False, tuple(range(layer, self.geometry.num_layers)), "aborted"
                    )
                if not self.liveness():
                    return TransferResult(
                        False, tuple(range(layer, self.geometry.num_layers)), "donor lost"
                    )
                sk.store_layer(
                    self.arena,
                    layer,
                    k_buffers[layer],
                    v_buffers[layer],
                    slots,
                    blocks,
                    self.geometry,
                    backend=self.backend,
                    plan=plan,
                    tuning=self.tuning,
                    validate=False,
                )
            return TransferResult(True, (), None)

        handle = TransferHandle(None, sync=getattr(self.lane, "synchronize", None))
        handle._future = self.lane.submit(job)
        return handle

    def begin_load(
        self,
        k_buffers,
        v_buffers,
        slots,
        blocks,
        counter,
        before_layer: Callable[[int], None] | None = None,
    ) -> TransferHandle:
        """Scatter `blocks` back into local `slots`, layer by layer, signalling `counter`.

        Arms the counter's next slot (`counter.update_producer()`); the handle's `producer_id`
        is the index the batch consumes (`counter.set_consumer(handle.producer_id)`).
        `before_layer(l)` is a test hook called on the copy lane before layer l.
        """
        slots, blocks, plan = self._check(k_buffers, v_buffers, slots, blocks)
        pid = counter.update_producer()
        handle = TransferHandle(None, counter, pid, getattr(self.lane, "synchronize", None))
        num_layers = self.geometry.num_layers

        def job():
            for layer in range(num_layers):
                if before_layer is not None:
                    before_layer(layer)
                if counter.aborted(pid):  # timed out or failed by someone else: stop copying
                    return TransferResult(
                        False, counter.failed_layers(pid), counter.failure_reason(pid)
                    )
                reason = (
                    "aborted"
                    if handle._abort.is_set()
                    else None
                    if self.liveness()
                    else "donor lost"
                )
                if reason is None:
                    try:
                        sk.load_layer(
                            self.arena,
                            layer,
                            k_buffers[layer],
                            v_buffers[layer],
                            slots,
                            blocks,
                            self.geometry,
                            backend=self.backend,
                            plan=plan,
                            tuning=self.tuning,
                            validate=False,
                        )
                    except Exception as e:  # noqa: BLE001 - reported as failed layers
                        reason = f"copy failed: {e}"
                if reason is not None:
                    return TransferResult(False, counter.fail(reason, pid), reason)
                counter.complete(layer, pid, stream=self.lane.stream)
            return TransferResult(True, (), None)

        handle._future = self.lane.submit(job)
        return handle
