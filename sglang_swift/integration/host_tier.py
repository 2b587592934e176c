"""The host tier of SwiftCache's tree: SGLang's own host KV pool, as HiCache's options build it.

With `--enable-hierarchical-cache`, a SwiftCache server keeps the prefixes it evicts from the
device in this order: donor pages while a lease has room (a borrower), then host memory. The host
memory is SGLang's host pool class for the server's device pool (`get_mha_host_pool_cls`:
`MHATokenToKVPoolHost` and its variants; `MLATokenToKVPoolHost` for an MLA pool), sized by
`--hicache-ratio` / `--hicache-size`, laid out by `--hicache-mem-layout`, and every byte moves
through its own transfer methods (`backup_from_device_all_layer`, `load_to_device_per_layer`)
with `--hicache-io-backend`: on a GPU SGLang's kernels, in the CPU venv the stand-ins of
`cpu_compat/hicache.py`. The tree's `HostTier` books the pool's token slots 0 .. capacity-1; the
pool's own allocator stays unused.

With `--tp > 1` every rank builds its own host pool over its own device pool (its shard of the
KV heads) and books the same slots in its tree: the trees are identical, so every store, load and
room made is decided alike on every rank. What a rank's own copy decides is agreed (`tp`,
`tp_sync.TpGroup`): a store or load that raised on any rank raises on every rank (`HostCopyFailed`),
so each caller drops the same prefixes everywhere.

`host_tier_problems` lists the HiCache options SwiftCache's host tier does not honour yet, each
with the option named and what to pass instead; the launcher refuses them before any model loads.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any

import torch

logger = logging.getLogger(__name__)

# HiCache's write policies the host tier implements: write_back, a prefix is copied to host when
# it leaves the device (the tiers hold different prefixes: their capacities add up); and
# write_through, every prefix the device caches is copied to host when the tree takes it (a
# device eviction then copies nothing, a reclaimed donor page has its host copy already).
# write_through_selective (host copies only of prefixes hit twice) is not implemented.
WRITE_POLICIES = ("write_back", "write_through")
# Host layouts with a per-layer row view of the pool's buffer (`HostKV.write_rows`), which a
# borrower needs to keep what a reclaimed donor page held.
ROW_LAYOUTS = ("layer_first", "page_first")
SPILL_FRACTION = 64  # of the host pool, kept out of the tier for a reclaim's writes to L3


def host_tier_problems(server_args: Any, config: Any) -> list[str]:
    """Why `--enable-swiftcache` cannot serve these HiCache options (empty: it can)."""
    problems = []
    policy = getattr(server_args, "hicache_write_policy", "write_through")
    if policy not in WRITE_POLICIES:
        problems.append(
            f"--hicache-write-policy {policy} (SwiftCache's host tier implements "
            f"{' and '.join(WRITE_POLICIES)}: pass --hicache-write-policy write_through)")
    mode = getattr(server_args, "hicache_host_memory_mode", "cache")
    if mode != "cache":
        problems.append(f"--hicache-host-memory-mode {mode} (the host tier caches prefixes: "
                        f"use --hicache-host-memory-mode cache)")
    layout = getattr(server_args, "hicache_mem_layout", "layer_first")
    if getattr(config, "borrows", False) and layout not in ROW_LAYOUTS:
        problems.append(f"--hicache-mem-layout {layout} with --swiftcache-max-borrow-blocks (a "
                        f"reclaimed donor page is moved into host memory by layer rows: use "
                        f"--hicache-mem-layout {' or '.join(ROW_LAYOUTS)})")
    if getattr(config, "streams_layers", False):
        problems.append("--swiftcache-layer-stream with --enable-hierarchical-cache (the layer "
                        "stream cache keeps its own host store: drop one of the two)")
    tp_size = getattr(server_args, "tp_size", 1) or 1
    backend = getattr(server_args, "hicache_storage_backend", None)
    if backend and tp_size > 1:
        problems.append(f"--hicache-storage-backend {backend} with --tp {tp_size} (L3's hit "
                        f"queries, fetches and the host slots its writes hold are each rank's "
                        f"own and not agreed between the ranks yet: drop "
                        f"--hicache-storage-backend or serve with --tp 1)")
    return problems


class HostCopyFailed(RuntimeError):
    """A host tier copy failed on this rank or, with TP, on another: the caller drops what it
    would have copied (every rank alike)."""


def _gather(records: Any, dev_side: str, host_side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The device and host slot indices of tree records, as two CPU int64 tensors in order."""
    dev, host = array("q"), array("q")
    for r in records:
        dev.extend(getattr(r, dev_side).indices)
        host.extend(getattr(r, host_side).indices)
    return (torch.frombuffer(dev, dtype=torch.int64).clone() if len(dev) else
            torch.empty(0, dtype=torch.int64),
            torch.frombuffer(host, dtype=torch.int64).clone() if len(host) else
            torch.empty(0, dtype=torch.int64))


def place_indices(io_backend: str, layout: str, device: torch.device, host_slots: torch.Tensor,
                  device_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(host, device) slot indices where the host pool's copies for `io_backend` read them, by
    HiCache's rule (`touchpoints.HOST_INDEX_RULE`, checked against SGLang's at start-up):
    kernel copies take the host indices on the device; direct ones take the device indices on
    the host, layer_first's sorted in host order. Moves are non-blocking."""
    if io_backend == "kernel":
        return host_slots.to(device, non_blocking=True), device_slots
    if io_backend == "direct" and layout == "layer_first":
        host_sorted, order = host_slots.sort()
        return host_sorted, device_slots.cpu().index_select(0, order)
    if io_backend == "direct" and layout == "page_first_direct":
        return host_slots, device_slots.cpu()
    raise ValueError(f"--hicache-io-backend {io_backend} with --hicache-mem-layout {layout} is "
                     f"not served by SwiftCache's host tier: use --hicache-io-backend kernel, or "
                     f"direct with layer_first or page_first_direct")


class HostKV:
    """Host memory for the tree's host tier: SGLang's host pool over device pool `kv_pool`.

    `store(device_slots, host_slots)` copies every layer of device rows into host rows;
    `load_layer(host_slots, device_slots, layer)` copies one layer back. Both issue their copies
    on the caller's stream (GPU: ordered with the forward that follows, no host wait; CPU: done
    when they return). Index tensors: int64, host slots on the CPU, device slots on the pool's
    device. With `tp` (a `tp_sync.TpGroup`, --tp > 1) `store_copies` and `load_copies` are
    collectives: every rank calls them at the same point (the trees decide alike), and each
    raises `HostCopyFailed` on every rank when the copy failed on any."""

    def __init__(self, kv_pool: Any, *, ratio: float, size_gb: int, layout: str,
                 io_backend: str, page_size: int, write_through: bool = False, tp: Any = None):
        from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

        from ..cpu_compat import hicache as cpu_hicache
        from ..dataplane.pool_lease import is_latent_pool

        if cpu_hicache.cpu_engine_active():  # the CPU copies serve the pairs a GPU serves
            cpu_hicache.check_pair(io_backend, layout)
        infos = kv_pool.get_device_pool_infos()
        if len(infos) != 1:
            raise ValueError(f"SwiftCache's host tier serves one MHA or MLA device pool; this "
                             f"server's KV cache has {len(infos)} pools")
        info = infos[0].buffer_info
        # an MLA pool (one latent buffer per layer) is mirrored by SGLang's MLA host pool
        self.latent = is_latent_pool(kv_pool)
        if self.latent:
            from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

            cls = MLATokenToKVPoolHost
            shape = dict(target_layer_num=kv_pool.layer_num,
                         override_kv_cache_dim=kv_pool.kv_cache_dim)
        else:
            cls = get_mha_host_pool_cls(info)
            shape = dict(write_back_staging=getattr(kv_pool, "hicache_write_back_staging", None))
        self.kv_pool = kv_pool
        self.io_backend = io_backend
        self.pool = cls(info, ratio, size_gb, page_size, layout,
                        device_capacity_tokens=kv_pool.size, start_layer=kv_pool.start_layer,
                        end_layer=kv_pool.end_layer, **shape)
        self.capacity = self.pool.size
        self.page_size = page_size
        self.spill_slots: torch.Tensor | None = None  # reserve_spill's slots, outside the tier
        self.write_through = write_through  # --hicache-write-policy write_through
        self.tp = tp  # tp_sync.TpGroup with --tp > 1, else None
        self.token_bytes = self.pool.size_per_token
        self.device = torch.device(kv_pool.device) if isinstance(kv_pool.device, str) \
            else kv_pool.device
        logger.info("SwiftCache host tier: %s, %d tokens (%.2f GB), layout %s, io %s",
                    cls.__name__, self.capacity, self.capacity * self.token_bytes / 1e9,
                    layout, io_backend)

    @classmethod
    def from_server_args(cls, kv_pool: Any, server_args: Any, page_size: int,
                         tp: Any = None) -> "HostKV":
        """Sized and laid out by the server's HiCache options, as SGLang resolved them (with
        TP, per rank: `kv_pool` is this rank's shard, and so is the host pool built over it)."""
        ratio = getattr(server_args, "hicache_ratio", None) or 2.0
        return cls(kv_pool, ratio=float(ratio), size_gb=int(server_args.hicache_size or 0),
                   layout=server_args.hicache_mem_layout,
                   io_backend=server_args.hicache_io_backend, page_size=page_size,
                   write_through=server_args.hicache_write_policy == "write_through", tp=tp)

    def _agreed(self, copy: Any, what: str) -> Any:
        """`copy()`'s result when it succeeded here and, with TP, on every rank; else
        `HostCopyFailed` (on every rank: the outcome is gathered before anyone raises)."""
        error = None
        try:
            out = copy()
        except Exception as exc:  # noqa: BLE001 - reported to every rank, raised below
            error, out = exc, None
        ok = error is None
        if self.tp is not None:
            ok = self.tp.all_ok(ok)
        if ok:
            return out
        if error is None:
            raise HostCopyFailed(f"a host tier {what} failed on another TP rank")
        raise HostCopyFailed(f"a host tier {what} failed: {error!r}") from error

    def _indices(self, host_slots: torch.Tensor,
                 device_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both index tensors where the io backend and layout want them (`place_indices`)."""
        return place_indices(self.io_backend, self.pool.layout, self.device, host_slots,
                             device_slots)

    def store(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        h, d = self._indices(host_slots, device_slots.to(self.device, non_blocking=True))
        self.pool.backup_from_device_all_layer(self.kv_pool, h, d, self.io_backend)

    def store_copies(self, copies: Any) -> int:
        """`store` for tree records with `.src` device and `.dst` host residencies (store
        tickets, write-through transfers), in one call; returns the tokens copied. Raises
        `HostCopyFailed` (with TP: on every rank) when the copy failed."""
        def copy() -> int:
            dev, host = _gather(copies, "src", "dst")
            if len(dev):
                self.store(dev, host)
            return len(dev)
        return self._agreed(copy, "store")

    def load_layer(self, host_slots: torch.Tensor, device_slots: torch.Tensor,
                   layer: int) -> None:
        h, d = self._indices(host_slots, device_slots.to(self.device, non_blocking=True))
        self.pool.load_to_device_per_layer(self.kv_pool, h, d, layer, self.io_backend)

    def load_copies(self, copies: Any, on_layer: Any) -> int:
        """Every layer of tree load records (`.src` host, `.dst` device residencies) in one
        transfer, the indices placed once; `on_layer(layer)` after each layer's copy is issued.
        Returns the tokens loaded. Raises `HostCopyFailed` (with TP: on every rank, after this
        rank's layers) when the copy failed: its requests must not use what it loaded."""
        def copy() -> int:
            dev, host = _gather(copies, "dst", "src")
            h, d = self._indices(host, dev.to(self.device, non_blocking=True))
            for layer in range(self.num_layers):
                self.pool.load_to_device_per_layer(self.kv_pool, h, d, layer, self.io_backend)
                on_layer(layer)
            return len(dev)
        return self._agreed(copy, "load")

    def reserve_spill(self, tokens: int | None = None) -> torch.Tensor:
        """Take the pool's last `tokens` slots (default: 1/SPILL_FRACTION of the pool in whole
        pages, at least one page) out of the tree's host tier (`capacity` shrinks by them) and
        keep them as `spill_slots`: the rows a reclaim writes on to L3 when the tier has no room
        for them pass through these slots (`StorageHits.spill`). Call before
        the tree is built."""
        if tokens is None:
            page = self.page_size
            tokens = max(page, self.capacity // SPILL_FRACTION // page * page)
        if not 0 < tokens < self.capacity:
            raise ValueError(f"a spill area of {tokens} tokens does not fit a host tier of "
                             f"{self.capacity}")
        self.capacity -= tokens
        self.spill_slots = torch.arange(self.capacity, self.capacity + tokens,
                                        dtype=torch.int64)
        return self.spill_slots

    def write_rows(self, host_slots: torch.Tensor, k_rows: list, v_rows: list) -> None:
        """Write token rows (per layer, `[n, heads, dim]` on any device; an MLA pool's latent
        rows as `k_rows` and no `v_rows`) into `host_slots`, through the pool's per-layer views
        of its buffer (ROW_LAYOUTS only): how a donor page's content reaches host memory when
        the donor takes the page back."""
        buf = self.pool.kv_buffer  # MHA: [K or V, ...]; MLA: the latent rows alone
        parts = ((buf, k_rows),) if self.latent else ((buf[0], k_rows), (buf[1], v_rows))
        idx = host_slots.to("cpu")
        for part, per_layer in parts:
            for layer, rows in enumerate(per_layer):
                view = part[layer] if self.pool.layout == "layer_first" else part[:, layer]
                view.index_copy_(0, idx, rows.to("cpu", view.dtype))

    @property
    def num_layers(self) -> int:
        return self.kv_pool.layer_num
