"""L3 below SwiftCache's host tier: one of SGLang's storage backends, as HiCache drives it.

With `--enable-swiftcache --enable-hierarchical-cache --hicache-storage-backend NAME`, prefixes
that reach SwiftCache's host tier are also written to storage, and a request whose prefix the
tree does not hold is looked up there and fetched into host memory before the scheduler admits
it (the `--hicache-storage-prefetch-policy`), then loaded like any host hit. Everything that
touches storage is SGLang's: the backend is built by `StorageBackendFactory` from a
`HiCacheStorageConfig` made as HiCache's controller makes it; pages are keyed by
`get_storage_hash_str` (the namespace seed and hash chain HiCache uses, so a SwiftCache server
and a HiCache server of the same model share one store); the backend's config, queries, reads
and writes follow HiCache's controller over the backend's public interface
(`storage_pages.py`: zero-copy for the backends HiCache runs zero-copy).

Two threads do the I/O, as HiCache's controller does: writes (host -> storage) and prefetches
(a hit query, then reads storage -> host). The scheduler thread books host slots, hands them
over and takes them back in `poll()`; host slots a write reads are held in the host tier until
the write is done, so room made meanwhile never hands them out.

Faults: a backend that cannot be built leaves the server without L3 (the log names the backend
and the error); a query, read or write that raises counts as a miss or a failed write, logged
once per kind; nothing read is used past the first page that failed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .storage_pages import StoragePages, is_zero_copy, storage_config

logger = logging.getLogger(__name__)

# pages whose storage keys this server wrote or found, remembered so a prefix is written once
KNOWN_KEYS = 1 << 20


@dataclass(eq=False)
class Fetch:
    """A prefetch of one request: `tokens` (page-aligned) continue the cached prefix of
    `start` tokens. `op` is SGLang's `PrefetchOperation` the I/O thread fills; `rid` and
    `host` the tree's host reservation once the hit is known."""

    handle: Any
    key: Any  # the request's full RadixKey, up to the end of the fetched span
    start: int
    op: Any
    deadline: float
    hit_tokens: int = -1  # -1: query in flight
    rid: Optional[int] = None
    host: Optional[torch.Tensor] = None
    reading: bool = False
    abandoned: bool = False  # its request was aborted: the pages join the tree, nobody waits
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class Write:
    keys: list
    host: torch.Tensor  # host slots, page by page
    held: Any  # array('q') of the slots the host tier holds for it
    ok_pages: int = 0


class StorageTier:
    """SGLang storage backend `name` below host memory `host_kv` (a `HostKV`)."""

    def __init__(self, host_kv: Any, server_args: Any, *, page_size: int, model_name: str):
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        self.name = server_args.hicache_storage_backend
        self.page_size = page_size
        self.policy = getattr(server_args, "hicache_storage_prefetch_policy", "timeout")
        (extra, self.threshold, self.timeout_base, self.timeout_per_ki,
         self.pass_prefix_keys) = HybridCacheController.parse_storage_backend_extra_config(
            getattr(server_args, "hicache_storage_backend_extra_config", None))
        if getattr(server_args, "file_storage_path", None):
            extra = dict(extra or {})
            extra.setdefault("file_storage_path", server_args.file_storage_path)
        self.threshold = max(int(self.threshold), page_size)
        zero_copy = is_zero_copy(self.name, extra)
        config = storage_config(host_kv, model_name, extra, page_size)
        self.backend = StorageBackendFactory.create_backend(self.name, config, host_kv.pool)
        self.backend.register_mem_pool_host(host_kv.pool)
        self.backend.on_host_pools_registered()
        self.pages = StoragePages(self.backend, host_kv.pool, page_size, zero_copy)
        self.failures = 0  # queries, reads and writes that raised (the I/O threads count)
        self._known: OrderedDict = OrderedDict()
        self._warned: set = set()
        self._writes: queue.Queue = queue.Queue()
        self._fetches: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(q, f), daemon=True,
                                          name=f"swiftcache-l3-{n}")
                         for n, q, f in (("write", self._writes, self._write),
                                         ("fetch", self._fetches, self._fetch))]
        for t in self._threads:
            t.start()
        logger.info("SwiftCache L3: %s (%s), prefetch policy %s, threshold %d tokens",
                    self.name, type(self.backend).__name__, self.policy, self.threshold)

    @classmethod
    def build(cls, host_kv: Any, server_args: Any, *, page_size: int,
              model_name: str) -> Optional["StorageTier"]:
        """The storage tier, or None (logged) when its backend cannot be built: the server then
        serves with device, donor and host tiers only."""
        try:
            return cls(host_kv, server_args, page_size=page_size, model_name=model_name)
        except Exception as e:  # noqa: BLE001 - a storage tier is optional; serving is not
            logger.error("SwiftCache L3: storage backend %r could not start (%s: %s); serving "
                         "without L3", server_args.hicache_storage_backend, type(e).__name__, e)
            return None

    # ---- keys ---------------------------------------------------------------------------------

    def page_keys(self, key: Any) -> list:
        """Storage keys of every whole page of `key` (a RadixKey: tokens and namespace), from
        the start of the sequence, as HiCache keys them."""
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        n = len(key) - len(key) % self.page_size
        if n == 0:
            return []
        return get_storage_hash_str(key[:n] if n < len(key) else key, None,
                                    page_size=self.page_size)

    def _unwritten(self, keys: list) -> list[int]:
        """Positions in `keys` of the pages not written or found yet."""
        return [i for i, k in enumerate(keys) if k not in self._known]

    def _remember(self, keys: Any) -> None:
        known = self._known
        for k in keys:
            known[k] = None
            known.move_to_end(k)
        while len(known) > KNOWN_KEYS:
            known.popitem(last=False)

    # ---- writes (scheduler thread, then the write thread) -------------------------------------

    def write(self, keys: list, host_slots: Any, host_tier: Any) -> int:
        """Write the pages `keys[i]` held at host slots `host_slots[i*page : (i+1)*page]`,
        skipping pages already written; the slots stay held in `host_tier` until done. Returns
        the pages queued."""
        page = self.page_size
        todo = self._unwritten(keys)
        if not todo:
            return 0
        from array import array

        held = array("q")
        for i in todo:
            held.extend(host_slots[i * page:(i + 1) * page])
        host_tier.hold(held)
        self._remember(keys[i] for i in todo)
        self._writes.put(Write([keys[i] for i in todo],
                               torch.frombuffer(held, dtype=torch.int64).clone(), held))
        return len(todo)

    def write_now(self, keys: list, host_slots: torch.Tensor) -> int:
        """Write the pages `keys[i]` held at host slots `host_slots[i*page : (i+1)*page]` on
        the calling thread, skipping pages already written, and wait for the backend: for rows
        held outside the tree's host tier only while this runs (a reclaim's spill). Returns the
        pages written (0 when the backend failed; logged once)."""
        page = self.page_size
        todo = self._unwritten(keys)
        if not todo:
            return 0
        slots = torch.cat([host_slots[i * page:(i + 1) * page] for i in todo]).to(torch.int64)
        try:
            ok = self.pages.set([keys[i] for i in todo], slots)
        except Exception as e:  # noqa: BLE001 - a failed write loses only the L3 copy
            self._warn("write", e)
            return 0
        if not ok:
            return 0
        self._remember(keys[i] for i in todo)
        return len(todo)

    def _write(self, w: Write) -> None:
        try:
            if self.pages.set(w.keys, w.host):
                w.ok_pages = len(w.keys)
        except Exception as e:  # noqa: BLE001 - a failed write loses only the L3 copy
            self._warn("write", e)
        self._done.put(w)

    # ---- prefetch (scheduler thread, then the fetch thread) -----------------------------------

    def begin_fetch(self, handle: Any, key: Any, start: int) -> Optional[Fetch]:
        """Look up the pages of `key[start:]` in storage (the cached prefix is `key[:start]`);
        None when the span is shorter than the prefetch threshold."""
        from sglang.srt.managers.cache_controller import PrefetchOperation

        n = len(key) - len(key) % self.page_size
        if n - start < self.threshold:
            return None
        prefix = self.page_keys(key[:start]) if start else []
        span = key[start:n]
        op = PrefetchOperation(getattr(handle, "rid", str(handle)), span,
                               prefix[-1] if prefix else None,
                               prefix if self.pass_prefix_keys else None)
        deadline = time.monotonic() + self.timeout_base + self.timeout_per_ki * (n - start) / 1024
        f = Fetch(handle, key[:n], start, op, deadline)
        self._fetches.put(f)
        return f

    def read(self, f: Fetch, rid: int, host_slots: torch.Tensor) -> None:
        """Fill `host_slots` (the tree's reservation `rid`) with the hit pages of `f`."""
        f.rid, f.host, f.reading = rid, host_slots, True
        f.op.host_indices = host_slots
        self._fetches.put(f)

    def _fetch(self, f: Fetch) -> None:
        if not f.reading:
            try:
                hashes, hit = self.pages.hit_query(f.op) if not f.op.is_terminated() \
                    else ([], 0)
            except Exception as e:  # noqa: BLE001 - a failed query is a miss
                self._warn("query", e)
                hashes, hit = [], 0
            f.op.hash_value = hashes[: hit // self.page_size]
            f.hit_tokens = len(f.op.hash_value) * self.page_size
            self._done.put(f)
            return
        from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

        page, op = self.page_size, f.op
        for i in range(0, len(op.hash_value), STORAGE_BATCH_SIZE):
            if op.is_terminated():
                break
            batch = op.hash_value[i:i + STORAGE_BATCH_SIZE]
            try:
                got = self.pages.get(op, batch, op.host_indices[i * page:(i + len(batch)) * page])
            except Exception as e:  # noqa: BLE001 - what failed is recomputed
                self._warn("read", e)
                got = 0
            op.completed_tokens += got * page
            if got < len(batch):
                break
        f.done.set()
        self._done.put(f)

    def terminate(self, f: Fetch) -> None:
        f.op.mark_terminate()

    # ---- both ---------------------------------------------------------------------------------

    def poll(self) -> list:
        """What the I/O threads finished since the last poll: `Write`s (done) and `Fetch`es
        (query answered, or read done)."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def drain(self) -> None:
        """Wait until the I/O threads finished everything handed to them (queries included)."""
        self._writes.join()
        self._fetches.join()

    def _run(self, q: queue.Queue, work: Any) -> None:
        while not self._stop.is_set():
            try:
                item = q.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                work(item)
            finally:
                q.task_done()

    def _warn(self, what: str, e: Exception) -> None:
        self.failures += 1
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("SwiftCache L3 (%s): a storage %s failed (%s: %s); the tier goes on "
                           "without those pages", self.name, what, type(e).__name__, e)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        if hasattr(self.backend, "close"):
            self.backend.close()
