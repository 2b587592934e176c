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
