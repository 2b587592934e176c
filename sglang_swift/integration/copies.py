"""Copies between this server's KV pool and donor pool pages, started without waiting.

`start_copy` asks the runtime for the lease's engine (None: the lease is gone or its donor is not
readable now), begins the transfer (a store; a load, or with `exchange` a donor hit swapped with
device victims, layer by layer under a counter) and registers it with the runtime, so that a
reclaim of its pages or a lost lease aborts it before the reclaim is acknowledged.
`InFlightCopy.finished()` says, without blocking, when nothing of the copy reads or writes memory
any more (CPU: the lane's job returned; GPU: the lane's stream passed a marker recorded after it),
and `release()` unregisters it. Nothing here waits, except `abort`, which returns once the layer
being copied is done (one layer's bytes: see docs/streaming.md "What the scheduler thread waits
for").

`store_now` is the other kind: a demotion store after which the caller frees the device slots at
once. CPU: it runs on the caller's thread (the scheduler thread is the device there), so it is
finished when it returns; it takes the victim's bytes over memory bandwidth and waits for nothing
else (not the copy thread, not a peer).
GPU: it is enqueued on the lease's side stream and the compute stream is made to wait for it, so
the host waits for the enqueue only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..dataplane import streams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class InFlightCopy:
    """One engine transfer in flight: lease `key`, lease-local `blocks`, `num_tokens` tokens."""

    key: tuple[str, int]
    handle: Any
    blocks: frozenset
    num_tokens: int
    marker: Any
    runtime: Any

    def finished(self) -> bool:
        """Nothing of this copy touches memory any more (never blocks)."""
        return self.handle.done() and streams.marker_done(self.marker)

    def confirm(self) -> str | None:
        """Whether the bytes this load read may be used, checked after its copy completed
        (`PoolTransferHandle.invalid`: donor alive, lease epoch unchanged, blocks not fenced
        since begin): None when they may, else the reason. CPU (no marker): the copy thread ran
        that check after each layer's copy, before releasing the layer, so nothing is left to
        check. GPU: the layers were released at enqueue (stream-side events), so the check runs
        here, once the marker recorded after the copy has passed: an event query, and only
        when the copy is still running after the forward was enqueued a wait for the copy's
        own remaining time (the forward's output, which SGLang waits for next, comes after it
        on the GPU anyway)."""
        if self.marker is None:
            return None
        result = self.handle.result()
        if result is not None and not result.ok:
            return result.reason
        if not streams.marker_done(self.marker):
            streams.wait_marker(self.marker)  # the settle's one wait (docs/streaming.md)
        return self.handle.invalid()

    def ok(self) -> bool:
        """Whether every layer was copied; call once `finished()`."""
        result = self.handle.result()
        return result is not None and result.ok

    def abort(self, reason: str) -> None:
        """Stop it; returns once nothing of it writes any more."""
        self.handle.abort(reason)

    def release(self) -> None:
        self.runtime.untrack(self.key, self.handle)


def _slot_tensor(slots: Any) -> tuple[torch.Tensor, bool]:
    """Slots as the engine takes them, and whether they are SGLang's own tensor (the tree's
    handle, on the device on a GPU: the engine must not read its values on the host)."""
    if isinstance(slots, torch.Tensor):
        return slots.to(torch.int64), True
    return torch.as_tensor(slots, dtype=torch.int64), False


def runs_by_lease(residencies: Sequence[Any]) -> list[tuple[tuple[str, int], list[int]]]:
    """Split donor residencies (in order) into runs on one lease with no block repeated within a
    run (an engine transfer writes each block once); each run is (lease key, item indices)."""
    runs: list[tuple[tuple[str, int], list[int]]] = []
    seen: set[int] = set()
    for i, res in enumerate(residencies):
        key = (res.donor, res.lease)
        if not runs or runs[-1][0] != key or seen.intersection(res.blocks):
            runs.append((key, []))
            seen = set()
        runs[-1][1].append(i)
        seen.update(res.blocks)
    return runs


def start_copy(runtime: Any, key: tuple[str, int], slots: Sequence[int], blocks: Sequence[int],
               counter: Any = None, exchange: bool = False) -> InFlightCopy | None:
    """Begin storing device `slots` into lease blocks `blocks` (token i into block
    `blocks[i // page_size]`), or, with `counter`, loading them back layer by layer, or with
    `counter` and `exchange`, swapping the two layer by layer (`begin_exchange`). None when
    the copy cannot start (the caller aborts the ticket: the prefix is recomputed)."""
    engine = runtime.lease_engine(*key)
    if engine is None:
        return None
    slot_tensor, pooled = _slot_tensor(slots)
    kind = "store" if counter is None else "exchange" if exchange else "load"
    try:
        if counter is None:
            handle = engine.begin_store(slot_tensor, blocks, allocator_slots=pooled)
        elif exchange:
            handle = engine.begin_exchange(slot_tensor, blocks, allocator_slots=pooled,
                                           counter=counter)
        else:
            handle = engine.begin_load(slot_tensor, blocks, counter, allocator_slots=pooled)
    except ValueError:  # a transfer the engine refuses is a bug, but not one to stop serving for
        logger.exception("SwiftCache: the copy engine refused a %s on lease %s", kind, key)
        return None
    copy = InFlightCopy(key, handle, frozenset(blocks), len(slot_tensor),
                        streams.done_marker(engine.lane), runtime)
    runtime.track(key, handle, set(blocks))
    return copy


def store_now(runtime: Any, key: tuple[str, int], slots: Sequence[int],
              blocks: Sequence[int]) -> tuple[bool, InFlightCopy | None]:
    """Store device `slots` into lease blocks `blocks` (token i into block
    `blocks[i // page_size]`) such that the slots may be freed and rewritten when this returns.

    Returns (ok, enqueued): `ok` is whether every layer was copied (GPU: enqueued); False when
    the copy could not start or stopped (lease gone, donor lost, read deadline passed), and the
    caller then aborts the ticket. `enqueued` is a GPU copy still running on its side stream,
    registered with the runtime so a reclaim stops it before the ack; the caller `release()`s it
    once `finished()`. On CPU it is None: the copy ran here and is done."""
    engine = runtime.lease_engine(*key)
    if engine is None:
        return False, None
    slot_tensor, pooled = _slot_tensor(slots)
    on_gpu = engine.lane.stream is not None
    # CPU: the copy thread's torch thread count (streams.CpuLane): on a busy machine an OpenMP
    # team of two per index op stalls on its barriers (20x slower measured here)
    threads = torch.get_num_threads()
    handle = None
    try:
        if on_gpu:
            handle = engine.begin_store(slot_tensor, blocks, allocator_slots=pooled)
            result = handle.result()  # the GPU job enqueued
        else:
            torch.set_num_threads(getattr(engine.lane, "threads", 1))
            result = engine.store_here(slot_tensor, blocks, allocator_slots=pooled)
    except Exception:  # noqa: BLE001 - a copy that fails is a lost prefix, not a dead server
        logger.exception("SwiftCache: a store on lease %s failed", key)
        return False, None
    finally:
        if not on_gpu:
            torch.set_num_threads(threads)
    ok = result is not None and result.ok
    if not on_gpu:
        return ok, None
    marker = streams.done_marker(engine.lane)
    streams.wait_event_on_current_stream(marker)  # later forwards rewrite the slots after it
    runtime.track(key, handle, set(blocks))
    return ok, InFlightCopy(key, handle, frozenset(blocks), len(slot_tensor), marker, runtime)
