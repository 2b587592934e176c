"""`LayerStreamKVPool`: SGLang's MHA KV pool with only a few layers' KV in local memory.

The pool keeps SGLang's logical shape: `size` slots, `k_buffer[l]` / `v_buffer[l]` of
`size + page_size` rows for every layer, so the allocator, `req_to_token`, radix tree and every
attention backend's indexing are unchanged. Physically the L layers' buffers alias `depth`
staging buffers (layer l uses staging l % depth), and every layer's rows live in a store: a
`HostLayerStore`, or a `DonorLayerStore` (donor pool pages under leases, backed by host memory;
same interface). Within one forward pass (opened by `begin_layer_stream`, from an AROUND hook on
`ModelRunner.forward`, which knows the batch):

- the first access to layer l (its `set_kv_buffer`, or a buffer getter, whichever the backend
  calls first) loads layer l's rows for the slots the batch reads (`slots.batch_read_slots`)
  into its staging buffer unless a prefetch already did, waits for that load, and starts the
  prefetch of layers l+1 .. l+depth-1 into the others (their staging buffers were last read by
  layers before l, which the compute stream has already been given);
- `set_kv_buffer` writes the new tokens into staging as SGLang does, then through to the store;
- the getters return the staging view, after the pool's layer-transfer counter (if another
  part of SwiftCache registered one) had its say, as for any pool.

Local KV memory is `depth` staging buffers instead of L layer buffers: at equal memory the pool
holds L/depth times the tokens. Outside a forward (start-up shape queries) the getters return
the staging views untouched. Host-side readers of the pool (retraction's CPU copy,
`move_kv_cache`) go to the store, which holds every layer.

**Resident rows** (`StreamSettings.resident_fraction` > 0): slots below `resident_rows` are
the layers' own memory, as in a stock pool (`layer_views.py` maps each layer's buffer from its
own rows and the shared staging rows), so they are never loaded, written through or stored; the
allocator hands them out first (`allocator.py`). A request that fits in the free resident slots
runs as on a stock server; the part of a context that does not is streamed. Without a mapping
(its set-up failed) the pool streams every row, which is always correct.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from .donor_store import DonorLayerStore
from .layer_views import LayerViews, aligned_rows, granularity
from .slots import SlotSet, forward_slots
from .store import CopyLane, HostLayerStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSettings:
    """How a streamed pool stages layers: `depth` staging buffers (the active layer and
    depth-1 prefetched), copies as runs while a slot set has at most `max_runs` of them."""

    depth: int = 2
    max_runs: int = 64
    tier: str = "host"  # where every layer lives: "host", or "donor" (leases, host-backed)
    # of local KV memory: every layer's own rows (never streamed); depth 0: of the pool's tokens
    resident_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.resident_fraction < 1.0:
            raise ValueError(f"layer-stream resident fraction must be in [0, 1); got "
                             f"{self.resident_fraction}")
        if self.tier not in ("host", "donor"):
            raise ValueError(f"layer-stream tier must be host or donor; got {self.tier!r}")
        if self.depth == 0:  # read in place (mapped.py): local rows are the resident ones
            if self.resident_fraction <= 0:
                raise ValueError("layer-stream depth 0 reads the rows past the local ones in "
                                 "place; it needs a resident fraction above 0 (the local part "
                                 "of the pool's tokens)")
        elif self.depth < 2:
            raise ValueError(f"layer-stream depth must be 0 (read in place) or at least 2 (the "
                             f"active layer and the one prefetched); got {self.depth}")

    def resident_tokens(self, tokens: int, layers: int) -> int:
        """Of a pool of `tokens`, how many are resident so that they take `resident_fraction` of
        its local memory (L rows each, against depth rows for a streamed one): R with
        L R = f (L R + depth (tokens - R)). Before alignment."""
        f, depth = self.resident_fraction, self.depth
        return int(f * depth * tokens / (layers * (1 - f) + f * depth))

    def resident_split(self, tokens: int, layers: int, page_size: int, row_bytes: int,
                       granularity: int) -> tuple[int, int]:
        """(R, mapped rows) of a pool of `tokens` with rows of `row_bytes` (one of K or V, one
        layer) mapped in units of `granularity` bytes, as the pool lays it out: R rounded down
        to whole pages and units, the rows rounded up to units. R = 0: every row is streamed
        (the rows are then the pool's, padded to a page)."""
        padded = -(-(tokens + page_size) // page_size) * page_size
        if self.resident_fraction <= 0:
            return 0, padded
        resident, mapped = aligned_rows(self.resident_tokens(tokens, layers), padded, row_bytes,
                                        granularity, page_size)
        return (resident, mapped) if resident > 0 else (0, padded)

    def tokens_per_local_token(self, layers: int) -> float:
        """Pool tokens per token of stock-pool memory: f + (1 - f) L / depth; at depth 0, where
        the resident fraction f of the tokens is all that is local, 1 / f."""
        f = self.resident_fraction
        if self.depth == 0:
            return 1 / f
        return f + (1 - f) * layers / self.depth


class LayerStreamKVPool(MHATokenToKVPool):
    """See the module docstring. Build with `LayerStreamKVPool.configured(settings)(...)`, with
    MHATokenToKVPool's own arguments."""

    settings = StreamSettings()
    _configured: dict = {}

    @classmethod
    def configured(cls, settings: StreamSettings) -> type:
        """The pool class with `settings` (one class per settings, so SGLang builds it with its
        own arguments)."""
        if settings not in cls._configured:
            cls._configured[settings] = type(cls.__name__, (cls,), {
                "settings": settings, "__module__": cls.__module__})
        return cls._configured[settings]

    # ---- buffers ------------------------------------------------------------------------------
    def _create_buffers_normal(self) -> None:
        problem = self._why_not_streamable()
        if problem is not None:
            raise ValueError(f"SwiftCache layer streaming cannot stream this KV pool: {problem}. "
                             f"Run without --swiftcache-layer-stream, or drop the option named.")
        depth = self.settings.depth
        (rows, *row_shape), _ = self._kv_buffer_shapes()
        padded = -(-rows // self.page_size) * self.page_size
        device = torch.device(self.device)
        self._views = self._resident_views(tuple(row_shape), device)
        self.resident_rows = self._views.resident if self._views is not None else 0
        if self._views is not None:
            self._layer_bufs = self._views.views
            self._stages = [self._views.staging(d) for d in range(depth)]
        else:
            with self.memory_saver_adapter.region("kv_cache"):
                self._stages = [torch.zeros((2, padded, *row_shape), dtype=self.store_dtype,
                                            device=device) for _ in range(depth)]
            self._layer_bufs = [self._stages[layer % depth] for layer in range(self.layer_num)]
        self.k_buffer = [buf[0, :rows] for buf in self._layer_bufs]
        self.v_buffer = [buf[1, :rows] for buf in self._layer_bufs]
        self._lane = CopyLane(device)
        host = HostLayerStore(self.layer_num, rows, tuple(row_shape), self.store_dtype, device)
        self.layer_store = host if self.settings.tier == "host" else DonorLayerStore(
            host, self.page_size, self._lane, self.settings.max_runs,
            first_row=self.resident_rows)
        self._holds: list[int | None] = [None] * depth  # layer each staging buffer holds now
        self._ready: list[object] = [None] * depth  # the lane's marker for that load
        # the marker of the write-through that last read each staging buffer's new rows: the
        # next write into that buffer (a later layer's, or the next forward's) waits for it
        self._saving: list[object] = [None] * depth
        self._read: SlotSet | None = None  # slots the running forward reads; None: no forward
        self._entered: int | None = None
        self._saved: set[int] = set()
        self._written: tuple[int, int, int] | None = None  # memo of the last write loc's slots
        self._written_slots = SlotSet.empty()
        self.forwards = 0
        logger.info("SwiftCache layer streaming: KV pool of %d tokens; local staging %d of %d "
                    "layers (%.1f MiB), every layer in %s (%.1f MiB); %d resident tokens (every "
                    "layer's rows local, in the MiB before, never streamed)", self.size, depth,
                    self.layer_num, self.local_kv_bytes() / 2**20, self.layer_store.where,
                    self.layer_store.nbytes / 2**20, self.resident_rows)

    def _resident_views(self, row_shape: tuple[int, ...],
                        device: torch.device) -> LayerViews | None:
        """The per-layer buffers with resident rows, or None (no resident rows asked for, too
        few to map, or the mapping failed: then every row streams, which is always correct)."""
        if self.settings.resident_fraction <= 0:
            return None
        row_bytes = int(torch.empty(row_shape, dtype=self.store_dtype).nbytes)
        try:
            grain = granularity(device)
            resident, mapped = self.settings.resident_split(self.size, self.layer_num,
                                                            self.page_size, row_bytes, grain)
            if resident <= 0:
                logger.warning("SwiftCache layer streaming: resident fraction %.2f of a %d-token "
                               "pool rounds to no whole mapping unit of %d bytes; every row is "
                               "streamed", self.settings.resident_fraction, self.size, grain)
                return None
            return LayerViews(self.layer_num, self.settings.depth, resident, mapped, row_shape,
                              self.store_dtype, device)
        except (OSError, RuntimeError) as e:
            logger.warning("SwiftCache layer streaming: cannot map resident rows (%s); every row "
                           "is streamed", e)
            return None

    def _why_not_streamable(self) -> str | None:
        if self.kv_cache_layout != "nhd" or self.use_hnd:
            return f"KV cache layout {self.kv_cache_layout!r} (only NHD is streamed)"
        k_shape, v_shape = self._kv_buffer_shapes()
        if k_shape != v_shape:
            return f"K and V rows differ in shape ({k_shape[1:]} vs {v_shape[1:]})"
        if self.settings.depth >= self.layer_num:
            return (f"--swiftcache-layer-stream-depth {self.settings.depth} is not below the "
                    f"model's {self.layer_num} layers (nothing would be streamed)")
        return None

    def local_kv_bytes(self) -> int:
        """Bytes of KV held in the pool's device memory: the staging buffers and resident rows."""
        if self._views is not None:
            return self._views.local_bytes
        return sum(s.numel() * s.element_size() for s in self._stages)

    def get_kv_size_bytes(self):
        half = self.local_kv_bytes() // 2
        return half, half

    def _clear_buffers(self):
        if getattr(self, "_lane", None) is not None:
            self._lane.drain()
            self._lane.close()
        super()._clear_buffers()
        self._stages, self._layer_bufs, self._views, self.layer_store = [], [], None, None

    # ---- one forward --------------------------------------------------------------------------
    def begin_layer_stream(self, forward_batch, req_to_token: torch.Tensor) -> None:
        """A forward pass of `forward_batch` starts: what it reads is loaded layer by layer."""
        self.forwards += 1
        read, written = forward_slots(forward_batch, req_to_token, self.settings.max_runs)
        self._read = read.from_slot(self.resident_rows)
        if written is not None:  # what its set_kv_buffer calls write, known already
            loc = forward_batch.out_cache_loc
            self._written = (loc.data_ptr(), loc.numel(), self.forwards)
            self._written_slots = written.from_slot(self.resident_rows)
        self._holds = [None] * self.settings.depth
        self._ready = [None] * self.settings.depth
        self._entered = None  # the layer this forward is in (its first access started it)
        self._saved = set()  # layers whose new rows this forward wrote through

    def end_layer_stream(self) -> None:
        self._read = None
        self._written = None

    def _stream_in(self, local_layer: int) -> None:
        """Make staging hold `local_layer` for this forward; prefetch the layers after it."""
        if self._read is None:
            return
        depth = self.settings.depth
        if self._entered != local_layer:  # the first access to this layer in this forward
            self._entered = local_layer
            for layer in range(local_layer, min(local_layer + depth, self.layer_num)):
                self._start_load(layer)  # this layer unless prefetched, then the ones after
        stage = local_layer % depth
        marker, self._ready[stage] = self._ready[stage], None
        self._lane.wait(marker)

    def _start_load(self, local_layer: int) -> None:
        stage = local_layer % self.settings.depth
        if self._holds[stage] == local_layer:
            return
        # A layer loaded again after its write-through (only if a backend went back to it)
        # needs the rows it wrote as well as the ones it reads.
        parts = [self._read] + ([self._written_slots] if local_layer in self._saved else [])
        parts = [part for part in parts if part.count]
        self._holds[stage] = local_layer
        if not parts:  # every slot read is resident
            return
        buf, store = self._layer_bufs[local_layer], self.layer_store

        def load() -> None:
            for part in parts:
                store.load(local_layer, part, buf)

        self._ready[stage] = self._lane.run(load)

    # ---- SGLang's pool interface --------------------------------------------------------------
    def get_key_buffer(self, layer_id: int):
        self._stream_in(layer_id - self.start_layer)
        return super().get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int):
        self._stream_in(layer_id - self.start_layer)
        return super().get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None,
                      layer_id_override=None, dcp_kv_mask=None):
        if dcp_kv_mask is not None:
            raise RuntimeError("SwiftCache layer streaming does not support decode context "
                               "parallelism (dcp); run without one or the other")
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        local = layer_id - self.start_layer
        self._stream_in(local)
        stage = local % self.settings.depth
        pending, self._saving[stage] = self._saving[stage], None
        self._lane.wait(pending)  # the rows a queued write-through still reads are not replaced
        super().set_kv_buffer(layer, loc_info, cache_k, cache_v, k_scale, v_scale,
                              layer_id_override, dcp_kv_mask)
        loc, _, _ = unwrap_write_loc(loc_info)
        written, buf, store = self._slots_of(loc), self._layer_bufs[local], self.layer_store
        if written.count:  # resident rows are where SGLang wrote them
            self._saving[stage] = self._lane.run(lambda: store.save(local, written, buf))
        self._saved.add(local)

    def _slots_of(self, loc: torch.Tensor) -> SlotSet:
        """The written slots; every layer of a forward writes the same loc, so once per forward:
        the batch's `out_cache_loc`, brought to the host with its read slots when the forward
        began (a loc of other memory is copied here)."""
        key = (loc.data_ptr(), loc.numel(), self.forwards)
        if self._written != key:
            self._written = key
            self._written_slots = SlotSet.of(loc, self.settings.max_runs).from_slot(
                self.resident_rows)
        return self._written_slots

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        self._lane.drain()
        if not self.resident_rows:
            self.layer_store.move_rows(tgt_loc, src_loc)
        else:
            for layer in range(self.layer_num):
                self._write_rows(layer, tgt_loc, *self._read_rows(layer, src_loc))
        self._holds = [None] * self.settings.depth  # staging may hold the old rows

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        self._lane.drain()
        return [[list(self._read_rows(layer, indices))] for layer in range(self.layer_num)]

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        self._lane.drain()
        for layer in range(self.layer_num):
            k, v = kv_cache_cpu[layer][0]
            self._write_rows(layer, indices, k, v)
        self._holds = [None] * self.settings.depth

    def _read_rows(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of `layer` at `index` (CPU tensors): resident ones from the layer's
        buffer, the others from the store."""
        index = index.to("cpu", torch.int64)
        low = index < self.resident_rows
        if not bool(low.any()):
            return self.layer_store.read_rows(layer, index)
        kv = self._layer_bufs[layer]
        out = torch.empty((2, index.numel(), *kv.shape[2:]), dtype=kv.dtype)
        out[:, low] = kv[:, index[low].to(kv.device)].cpu()
        if not bool(low.all()):
            k, v = self.layer_store.read_rows(layer, index[~low])
            out[0, ~low], out[1, ~low] = k, v
        return out[0], out[1]

    def _write_rows(self, layer: int, index: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        index = index.to("cpu", torch.int64)
        low = index < self.resident_rows
        if bool(low.any()):
            kv, at = self._layer_bufs[layer], index[low].to(self._layer_bufs[layer].device)
            kv[0, at] = k[low.to(k.device)].to(kv.device, kv.dtype)
            kv[1, at] = v[low.to(v.device)].to(kv.device, kv.dtype)
        if not bool(low.all()):
            high = ~low
            self.layer_store.write_rows(layer, index[high], k[high.to(k.device)],
                                        v[high.to(v.device)])

    def stream_stats(self) -> dict:
        """Counters for logs and benchmarks."""
        store = self.layer_store
        return {"forwards": self.forwards, "rows_loaded": store.rows_loaded,
                "rows_saved": store.rows_saved, "copy_s": self._lane.busy_s,
                "local_kv_bytes": self.local_kv_bytes(), "store_bytes": store.nbytes,
                "resident_rows": self.resident_rows,
                "rows_from_donor": getattr(store, "rows_from_donor", 0),
                "pages_on_donor": getattr(store, "pages_on_donor", 0)}
