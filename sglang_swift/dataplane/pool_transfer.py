"""Copies between a borrower's own SGLang pool and the pool pages a donor lent it (a pool lease).

`PoolTransferEngine` serves one lease: the borrower's per-layer K / V buffers, the donor's mapped
region and the lease's `LeasePacking`. Two-phase (STYLE 3; the handle is in transfer.py):
`begin_store(slots, blocks)` / `begin_load(slots, blocks, counter)` / `begin_exchange(slots,
blocks[, counter])` (both directions at once, for a donor hit swapped with device victims; with a
counter, released layer by layer as a load is) validate everything and start the copy on the lane;
the returned handle's `wait()` completes it, `result()` peeks, `abort(reason)` abandons it.
`blocks` are lease-local borrower blocks (0 .. num_blocks - 1).

Per layer and K/V, one gather (`index_select`) on the source device and one scatter
(`index_copy_`) on the destination device move every unit of the transfer, through a
cross-device copy when the two differ (a borrower on cuda:0, the donor's pool on cuda:1); on CPU
the same code runs with both devices "cpu" (shared memory), which is how the tests exercise it.

Safety, checked before every layer: the handle was not aborted, the consumer did not give up
on the load (the layer counter's slot failed), the donor is alive (`liveness`), and the lease's
read deadline has not passed (`read_deadline`, on `clock`): a store never writes donor pages and
a load never reads them after the deadline. `abort()` returns only once nothing of this
transfer writes any more: on CPU it waits for the layer being copied (a lock spans each layer),
on a GPU it synchronizes the lane's streams after stopping further enqueues.

Validity after the copy (no stale bytes): bytes read from donor pages are used only if the lease
was valid for the whole copy, checked AFTER the copy and before anyone may read them (`_invalid`:
not aborted, donor alive per `liveness`, lease epoch unchanged since begin per `lease_epoch`,
blocks not fenced since begin, read deadline not passed; death, a new epoch, a fence and an abort
are permanent, so a check after completion covers the whole copy). On CPU it runs on the copy
thread after each layer's copy, under the layer lock, before `counter.complete(layer)`: an invalid
layer fails the counter slot instead (attention gets "failed" and goes on; the caller drops the
request's output). On a GPU the layer's copy is only enqueued there, so that check sees the state
at enqueue; the check that counts runs once the copy's completion is seen
(`PoolTransferHandle.invalid()`, called by `InFlightCopy.confirm` in integration/copies.py after
the copy's marker event passed, before the batch's output is used). The check itself never
blocks (host state only, no device synchronisation); on a GPU `confirm` waits for the marker only
when the copy is still running once the batch's forward is enqueued.

Fence (a reclaim acknowledged from the control agent's thread, `copy_fence.py`): `fence(blocks)`
refuses every later copy touching those blocks (its handle comes back failed, nothing moves) and
aborts the copies in flight touching them, returning once none of them touches memory: on CPU
after at most the layer each is copying (one layer of one transfer), on a GPU once this lease's
lane has run what it had enqueued. Any thread may call it.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

import swift_kernels as sk
from swift_kernels import K

from .copy_fence import CopyFence
from .packing import CopyPlan, LeasePacking
from .pool_rows import STAGING_BYTES, check_buffers, index_to_device, resolve_backend, unit_rows
from .streams import make_lane
from .transfer import PoolTransferHandle, TransferResult

_here = threading.local()  # per thread: the staging buffer of the stores it runs (store_here)


class PoolTransferEngine:
    """Copies for one pool lease: `k_buffers[l]` / `v_buffers[l]` are the borrower's SGLang pool
    (NHD `[rows, heads, dim]`, contiguous, as `packing.borrower` says; a latent page: an MLA
    pool's latent buffers, and no V buffers), `region` the donor's pool
    bytes as mapped (`MappedPool.region`), `packing` the lease's `LeasePacking`."""

    def __init__(self, packing: LeasePacking, region: torch.Tensor, k_buffers, v_buffers, *,
                 liveness: Callable[[], bool] | None = None,
                 read_deadline: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.monotonic, lane=None, cpu_threads: int = 1,
                 backend: str = "auto", lease_epoch: Callable[[], object] | None = None):
        g = packing.borrower
        check_buffers(g, k_buffers, v_buffers)
        if region.dtype != torch.uint8 or region.dim() != 1:
            raise ValueError(f"region must be the donor pool's flat uint8 bytes, got "
                             f"{region.dtype} {tuple(region.shape)}")
        need = packing.donor.data_offset + packing.donor.data_bytes
        if region.numel() < need:
            raise ValueError(f"region of {region.numel()} bytes is smaller than the donor "
                             f"pool's layout ({need}); map it with map_pool(descriptor)")
        self.local_device, self.donor_device = k_buffers[0].device, region.device
        if self.local_device.type != self.donor_device.type:
            raise ValueError(f"borrower pool on {self.local_device} and donor pool on "
                             f"{self.donor_device}: both must be CPU or both CUDA")
        self.packing, self.region = packing, region
        self.k, self.v = list(k_buffers), list(v_buffers)
        self.rows = k_buffers[0].shape[0]
        self.liveness = liveness or (lambda: True)
        self.read_deadline = read_deadline or (lambda: math.inf)
        self.clock = clock
        # the lease's incarnation as the borrower knows it now (None: lost); a copy's bytes are
        # used only if it is the one the copy began under
        self.lease_epoch = lease_epoch or (lambda: 0)
        self.backend = resolve_backend(backend, self.local_device, self.donor_device)
        self._own_lane = lane is None
        self.lane = lane or make_lane(self.local_device, cpu_threads, peer=self.donor_device)
        staged = self.backend == "staged"
        self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8) if staged else None
        ptrs = [region.data_ptr()] + [t.data_ptr() for t in self.k + self.v]
        # 16-byte rows (complex128) make CPU index ops run as memcpy; Triton has no complex
        self._max_width = 16 if self.backend in ("staged", "reference") and \
            self.local_device.type == "cpu" else 8
        self._ptr_align = math.gcd(*ptrs, self._max_width)
        self.copy_fence = CopyFence()
        self._views: dict = {}  # unit -> (donor rows, K rows, V rows): `_row_views`
        if self.backend == "triton":
            self.warm_up()

    def warm_up(self) -> None:
        """Compile the row copy for every row shape this lease's transfers use (its two unit
        widths: whole aligned pages, and token rows), so the first hit does not compile on
        the scheduler thread. Built when the lease is granted; copies one unit row of the donor
        region and of the local pool into a scratch row, writing nothing of either."""
        g, unit = self.packing.borrower, self.packing.unit
        for width in sorted({unit, math.gcd(unit, g.k_row_elems * g.itemsize,
                                            g.v_row_elems * g.itemsize)}):
            donor, k_rows, _ = self._row_views(width)
            first = torch.zeros(1, dtype=torch.int64, device=self.local_device)
            with torch.cuda.device(self.local_device) if self.local_device.type == "cuda" \
                    else contextlib.nullcontext():
                for src in (donor, k_rows[0]):
                    scratch = torch.empty_like(src[:1])
                    self._move(src, first, scratch, first, None)

    def close(self) -> None:
        if self._own_lane:
            self.lane.close()

    # ---- the fence (any thread) ----------------------------------------------------------------
    def fence(self, blocks, reason: str = "reclaimed by the donor") -> int:
        """Refuse later copies touching lease blocks `blocks`, abort those in flight, and return
        once none of them touches memory (see the module docstring for the bound). Returns how
        many copies were aborted."""
        hit = self.copy_fence.fence(blocks)
        for handle in hit:
            handle.abort(reason)  # waits out the layer it is copying (GPU: syncs the lane)
        sync = getattr(self.lane, "synchronize", None)
        if sync is not None:  # GPU: copies already enqueued, their handles retired or not
            sync()
        return len(hit)

    def fenced(self, blocks) -> bool:
        """Whether a copy touching `blocks` would be refused now."""
        return self.copy_fence.touches(blocks)

    # ---- the two transfers -------------------------------------------------------------------
    def begin_store(self, slots, blocks, allocator_slots: bool = False) -> PoolTransferHandle:
        """Copy borrower tokens `slots` (all layers, K and V) into lease blocks `blocks`: token
        i goes to row i % page_size of block `blocks[i // page_size]`. The caller keeps those
        blocks locked (not evictable, not released) until the handle completes.

        `allocator_slots` (every begin_* / *_here takes it): `slots` is a tensor of SGLang's
        allocator as the tree holds it, on the pool's device: distinct slots in range, whole
        aligned pages at page size > 1. Its values are then never read on the host (on a GPU
        that would make the host wait for the device): not validated, the page runs taken as
        aligned, the local index rows computed on its device. Otherwise slots are validated."""
        return self._begin(slots, blocks, exchange=False, pooled=allocator_slots)

    def store_here(self, slots, blocks, allocator_slots: bool = False) -> TransferResult:
        """`begin_store` run to its end on the calling thread, for a CPU engine (a GPU engine
        enqueues on its lane: use `begin_store`). The lane's thread may be running a load of
        this engine meanwhile, so the copy uses the calling thread's own staging buffer; the
        fence applies as to any copy (a reclaim on another thread stops it between layers)."""
        return self._here(slots, blocks, exchange=False, pooled=allocator_slots)

    def begin_exchange(self, slots, blocks, allocator_slots: bool = False, counter=None,
                       before_layer: Callable[[int], None] | None = None) -> PoolTransferHandle:
        """Swap borrower tokens `slots` with lease blocks `blocks` (token i with row
        i % page_size of block `blocks[i // page_size]`), every layer, K and V: afterwards the
        slots hold what the blocks held and the blocks what the slots held. Per layer the
        slots' rows are set aside, the blocks' rows copied into the slots, then the set-aside
        rows into the blocks (one layer of the transfer held at a time, on the local device).
        Same handle, lane and fence as `begin_store`; with `counter`, layer by layer as
        `begin_load` (layer l completed once both sides of layer l are swapped and the bytes
        read checked; `before_layer` as there). A failed exchange leaves both sides
        partly swapped: layers before the failed one swapped, later ones untouched, and the
        failed layer itself in any state (a copy that raised inside it may have written one
        side only), so the caller trusts neither side afterwards."""
        if counter is None:
            return self._begin(slots, blocks, exchange=True, pooled=allocator_slots)
        plan = self._plan(slots, blocks, store=False, pooled=allocator_slots)
        return self._begin_counted(plan, blocks, counter, self._exchange_layer, before_layer)

    def _begin(self, slots, blocks, exchange: bool, pooled: bool = False) -> PoolTransferHandle:
        """A store or an exchange started on the lane (GPU: enqueued from this thread)."""
        plan = self._plan(slots, blocks, store=not exchange, pooled=pooled)
        handle = self._arm(PoolTransferHandle(sync=getattr(self.lane, "synchronize", None)),
                           blocks)
        if plan is not None and not self.copy_fence.admit(handle, handle.blocks):
            return _refused(handle, self._fenced_store())
        copy_layer = self._exchange_layer if exchange else self._store_layer
        handle._future = self._submit(
            plan, lambda: self._layers_job(plan, handle, self._staging, copy_layer))
        return handle

    def exchange_here(self, slots, blocks, allocator_slots: bool = False) -> TransferResult:
        """`begin_exchange` run to its end on the calling thread, for a CPU engine (as
        `store_here`)."""
        return self._here(slots, blocks, exchange=True, pooled=allocator_slots)

    def load_here(self, slots, blocks) -> TransferResult:
        """Lease blocks `blocks` copied into local `slots`, every layer, run to its end on the
        calling thread, for a CPU engine (as `store_here`; no layer counter: the caller reads
        the slots once this returns ok)."""
        return self._here(slots, blocks, exchange=False, load=True)

    def _here(self, slots, blocks, exchange: bool, load: bool = False,
              pooled: bool = False) -> TransferResult:
        if self.lane.stream is not None:
            raise ValueError("store_here / exchange_here / load_here run a CPU engine's copy on "
                             "the caller's thread; a GPU engine's is enqueued with begin_*")
        plan = self._plan(slots, blocks, store=not (exchange or load), pooled=pooled)
        if plan is None:
            return TransferResult(True, (), None)
        handle = self._arm(PoolTransferHandle(), blocks)
        if not self.copy_fence.admit(handle, handle.blocks):
            return self._fenced_store()
        staging = None
        if self._staging is not None:
            staging = getattr(_here, "staging", None)
            if staging is None or staging.numel() < max(plan.unit, STAGING_BYTES):
                staging = _here.staging = torch.empty(max(plan.unit, STAGING_BYTES),
                                                      dtype=torch.uint8)
        copy_layer = (self._exchange_layer if exchange else self._load_layer if load
                      else self._store_layer)
        return self._layers_job(plan, handle, staging, copy_layer)

    def _layers_job(self, plan: CopyPlan, handle: PoolTransferHandle,
                    staging: torch.Tensor | None, copy_layer) -> TransferResult:
        num_layers = self.packing.borrower.num_layers
        try:
            for layer in range(num_layers):
                with handle.layer_lock:
                    reason = self._stop_reason(handle)
                    if reason is None:
                        reason = copy_layer(plan, layer, staging)
                    if reason is None:  # after the copy: were the bytes read valid throughout?
                        reason = self._invalid(handle)
                    if reason is not None:
                        return TransferResult(False, tuple(range(layer, num_layers)), reason)
            return TransferResult(True, (), None)
        finally:
            self.copy_fence.retire(handle)

    def _store_layer(self, plan: CopyPlan, layer: int,
                     staging: torch.Tensor | None) -> str | None:
        return self._copy_layer(plan, layer, store=True, staging=staging)

    def _load_layer(self, plan: CopyPlan, layer: int,
                    staging: torch.Tensor | None) -> str | None:
        return self._copy_layer(plan, layer, store=False, staging=staging)

    def _fenced_store(self) -> TransferResult:
        return TransferResult(False, tuple(range(self.packing.borrower.num_layers)), FENCED)

    def begin_load(self, slots, blocks, counter,
                   before_layer: Callable[[int], None] | None = None,
                   allocator_slots: bool = False) -> PoolTransferHandle:
        """Copy lease blocks `blocks` back into borrower `slots` layer by layer, completing
        `counter`'s layer l once layer l is in place (GPU: enqueued, with an event). Arms the
        counter's next slot; `handle.producer_id` is the batch's consumer index. After a failed
        wait, call `handle.abort(reason)` before the slots are reused. `before_layer(l)` is a
        test hook run on the lane before layer l. `allocator_slots`: see `begin_store`."""
        plan = self._plan(slots, blocks, store=False, pooled=allocator_slots)
        return self._begin_counted(plan, blocks, counter, self._load_layer, before_layer)

    def _begin_counted(self, plan: CopyPlan | None, blocks, counter, copy_layer,
                       before_layer: Callable[[int], None] | None) -> PoolTransferHandle:
        """A load or an exchange started on the lane, completing `counter`'s layer l once
        `copy_layer` moved layer l and the bytes it read are still valid."""
        pid = counter.update_producer()
        handle = self._arm(PoolTransferHandle(counter, pid, getattr(self.lane, "synchronize",
                                                                    None)), blocks)
        num_layers = self.packing.borrower.num_layers
        if plan is not None and not self.copy_fence.admit(handle, handle.blocks):
            return _refused(handle, TransferResult(False, counter.fail(FENCED, pid), FENCED))

        def job() -> TransferResult:
            try:
                for layer in range(num_layers):
                    if before_layer is not None:
                        before_layer(layer)
                    with handle.layer_lock:
                        reason = self._stop_reason(handle, counter, pid)
                        if reason is None:
                            reason = copy_layer(plan, layer, self._staging)
                        if reason is None:  # the layer landed: release it only if still valid
                            reason = self._invalid(handle)
                        if reason is not None:
                            return TransferResult(False, counter.fail(reason, pid), reason)
                    counter.complete(layer, pid, stream=self.lane.stream)
                return TransferResult(True, (), None)
            finally:
                self.copy_fence.retire(handle)

        if plan is None:  # nothing to copy: every layer is ready at once
            for layer in range(num_layers):
                counter.complete(layer, pid)
        handle._future = self._submit(plan, job)
        return handle

    # ---- internals ---------------------------------------------------------------------------
    def _submit(self, plan: CopyPlan | None, job) -> Future:
        if plan is None:
            done: Future = Future()
            done.set_result(TransferResult(True, (), None))
            return done
        return self.lane.submit(job)

    def _arm(self, handle: PoolTransferHandle, blocks) -> PoolTransferHandle:
        """Record what the copy begins under (its blocks, the lease epoch, the fence generation)
        and give the handle its after-copy check."""
        handle.blocks = frozenset(_ids(blocks))
        handle.epoch = self.lease_epoch()
        handle.fence_generation = self.copy_fence.generation
        handle._invalid = lambda: self._invalid(handle)
        return handle

    def _invalid(self, handle: PoolTransferHandle) -> str | None:
        """Why bytes `handle` copied may not be used (see "Validity after the copy" in the
        module docstring), or None. Host state only: never blocks, never syncs a device."""
        if handle._abort.is_set():
            return "aborted"
        if not self.liveness():
            return "donor lost"
        if self.lease_epoch() != handle.epoch:
            return "lease lost or granted again under a new epoch"
        if self.copy_fence.fenced_since(handle.fence_generation, handle.blocks):
            return FENCED
        if self.clock() >= self.read_deadline():
            return "read deadline passed"
        return None

    def _stop_reason(self, handle, counter=None, pid=None) -> str | None:
        if handle._abort.is_set():
            return "aborted"
        if counter is not None and counter.aborted(pid):
            return counter.failure_reason(pid) or "aborted by the consumer"
        if not self.liveness():
            return "donor lost"
        if self.clock() >= self.read_deadline():
            return "read deadline passed"
        return None

    def _plan(self, slots, blocks, store: bool, pooled: bool = False) -> CopyPlan | None:
        """Validate a transfer once and build its index tensors (None when it is empty).
        `pooled`: SGLang's slot tensor, whose values are not read here (`begin_store`)."""
        g, p = self.packing.borrower, self.packing
        if pooled:
            slots = slots.reshape(-1).to(torch.int64)
        else:
            slots = torch.as_tensor(slots, dtype=torch.int64).reshape(-1).cpu().contiguous()
        blocks = torch.as_tensor(blocks, dtype=torch.int64).reshape(-1).cpu().contiguous()
        n = slots.numel()
        if blocks.numel() != -(-n // g.page_size):
            raise ValueError(f"{n} tokens in pages of {g.page_size} need "
                             f"{-(-n // g.page_size)} blocks, got {blocks.numel()}")
        if n == 0:
            return None
        if pooled:
            pass  # SGLang's allocator: distinct slots in range (reading them would sync a GPU)
        elif int(slots.min()) < 0 or int(slots.max()) >= self.rows:
            raise ValueError(f"slots span [{int(slots.min())}, {int(slots.max())}] but the "
                             f"borrower's pool has {self.rows} rows")
        if int(blocks.min()) < 0 or int(blocks.max()) >= p.num_blocks:
            raise ValueError(f"blocks span [{int(blocks.min())}, {int(blocks.max())}] but the "
                             f"lease holds {p.num_blocks} borrower blocks")
        if blocks.unique().numel() != blocks.numel():
            raise ValueError("a block repeats within one transfer; split it into two")
        if not (store or pooled) and slots.unique().numel() != n:
            raise ValueError("a load writes one slot twice; every destination slot must differ")
        plan = p.plan(slots, blocks, aligned=(n % g.page_size == 0) if pooled else None)
        if self._staging is not None and self._staging.numel() < plan.unit:
            self._staging = torch.empty(plan.unit, dtype=torch.uint8)  # a unit above 2 MiB
        lane_stream = getattr(self.lane, "stream", None)
        peer_stream = getattr(self.lane, "peer_stream", None) or lane_stream
        local = tuple(index_to_device(t, self.local_device, lane_stream) for t in plan.local)
        stream = tuple(index_to_device(t, self.donor_device, peer_stream) for t in plan.stream)
        return CopyPlan(plan.unit, plan.layer_step, local, stream, plan.page_aligned)

    def _rows(self, flat: torch.Tensor, unit: int) -> torch.Tensor:
        """`flat` as unit rows as wide as every pointer of this engine allows (`unit_rows`)."""
        return unit_rows(flat, unit, self._ptr_align, self._max_width)

    def _row_views(self, unit: int) -> tuple[torch.Tensor, list, list]:
        """The donor region and every local K / V layer buffer as `unit` rows: views of buffers
        that live as long as the engine, made once per unit (a transfer has one of two)."""
        views = self._views.get(unit)
        if views is None:
            views = self._views[unit] = (
                self._rows(self.region, unit),
                [self._rows(b.view(torch.uint8).view(-1), unit) for b in self.k],
                [self._rows(b.view(torch.uint8).view(-1), unit) for b in self.v])
        return views

    def _layer_halves(self, plan: CopyPlan, layer: int):
        """For K then V of layer `layer`: (local rows, the transfer's slots among them, donor
        rows, the transfer's units among them), all as `_rows` views. The donor units of every
        layer are computed once, at the transfer's first layer, in one `donor_units` call per
        half (one per layer and half cost more than the copy itself for small transfers)."""
        donor, k_rows, v_rows = self._row_views(plan.unit)
        if not plan.donor_rows:
            num_layers = self.packing.borrower.num_layers
            for stream in plan.stream:  # offsets from the stream itself: no other tensor
                every = torch.cat([stream + n * plan.layer_step for n in range(num_layers)])
                units = self.packing.donor_units(every, plan.unit)
                plan.donor_rows.append(units.view(num_layers, -1))
        for half in self.packing.borrower.halves:
            local = (k_rows if half == K else v_rows)[layer]
            yield local, plan.local[half], donor, plan.donor_rows[half][layer]

    def _copy_layer(self, plan: CopyPlan, layer: int, store: bool,
                    staging: torch.Tensor | None) -> str | None:
        """Move layer `layer`'s K and V of the whole transfer; an error is returned as the
        reason (reported as failed layers) rather than raised on the lane."""
        try:
            halves = list(self._layer_halves(plan, layer))

            def work() -> None:
                for local, rows, donor, where in halves:
                    if store:
                        self._move(local, rows, donor, where, staging)
                    else:
                        self._move(donor, where, local, rows, staging)

            self.lane.launch(work)
        except Exception as exc:  # noqa: BLE001 - reported as failed layers
            return f"copy failed: {exc}"
        return None

    def _exchange_layer(self, plan: CopyPlan, layer: int,
                        staging: torch.Tensor | None) -> str | None:
        """Swap layer `layer`'s K and V of the transfer's slots and blocks (see
        `begin_exchange`); an error is returned as the reason, as `_copy_layer` does."""
        try:
            halves = list(self._layer_halves(plan, layer))

            def work() -> None:
                for local, rows, donor, where in halves:
                    held = local.index_select(0, rows)  # the slots' rows, before overwritten
                    self._move(donor, where, local, rows, staging)
                    order = torch.arange(held.shape[0], device=held.device)
                    self._move(held, order, donor, where, staging)

            self.lane.launch(work)
        except Exception as exc:  # noqa: BLE001 - reported as failed layers
            return f"copy failed: {exc}"
        return None

    def _move(self, src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor,
              dst_rows: torch.Tensor, staging: torch.Tensor | None) -> None:
        """dst[dst_rows] = src[src_rows] (swift_kernels.copy_rows; checked once in _plan)."""
        sk.copy_rows(src, src_rows, dst, dst_rows, backend=self.backend, staging=staging,
                     validate=False)


FENCED = "blocks fenced: reclaimed by the donor"


def _ids(blocks) -> list[int]:
    return torch.as_tensor(blocks, dtype=torch.int64).reshape(-1).tolist()


def _refused(handle: PoolTransferHandle, result: TransferResult) -> PoolTransferHandle:
    """A copy the fence refused: done at once, failed, nothing moved."""
    handle._future = Future()
    handle._future.set_result(result)
    return handle
