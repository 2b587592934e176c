"""Test helpers for copy engines (PoolTransferEngine): hold a copy inside one layer."""

from __future__ import annotations

import threading


def hold_in_layer(engine, held_layer: int, log: list) -> tuple[threading.Event, threading.Event]:
    """Make `engine`'s copies log ("start", l) / ("end", l) around each layer and, in layer
    `held_layer`, block until the returned `go` is set (`inside` is set once a copy is there),
    so a test can land a fence or a reclaim while that layer reads donor pages."""
    inside, go = threading.Event(), threading.Event()
    real_copy = engine._copy_layer

    def held_copy(plan, layer, store, staging):
        log.append(("start", layer))
        if layer == held_layer:
            inside.set()
            assert go.wait(30)
        out = real_copy(plan, layer, store, staging)
        log.append(("end", layer))
        return out

    engine._copy_layer = held_copy
    return inside, go


class DeferredStream:
    """What a GPU lane does to a copy, on CPU: `defer_copies(engine, stream)` makes the engine's
    layer copies only enqueue here (the lane job returns at once, every layer "ready" as on a
    GPU, where READY means enqueued); the bytes move when the test calls `run()`, or when a
    waiter synchronizes on `marker()` (a stand-in for the CUDA event recorded after the copy)."""

    def __init__(self):
        self.queued: list = []

    def run(self) -> None:
        queued, self.queued = self.queued, []
        for copy in queued:
            assert copy() is None

    def marker(self):
        stream = self

        class Marker:
            def query(self):
                return not stream.queued

            def synchronize(self):
                stream.run()

        return Marker()


def defer_copies(engine, stream: DeferredStream) -> None:
    real_copy = engine._copy_layer

    def enqueue(plan, layer, store, staging):
        stream.queued.append(lambda: real_copy(plan, layer, store, staging))
        return None

    engine._copy_layer = enqueue
