"""L3 in SwiftCache's tree (a collaborator of `SwiftRadixCache`, built before it: `build.py`):
what SGLang's scheduler calls on a tree when `--hicache-storage-backend` is set, over a
`storage_tier.StorageTier`. A tree without L3 gets `NoStorageHits` (nothing fetched or written).

The scheduler, as for HiCache: when a request arrives it matches it and calls
`prefetch_from_storage` with the part the tree does not hold; before admitting it,
`check_prefetch_progress` (False: keep it waiting) and `pop_prefetch_loaded_span` (the tokens
storage supplied, SGLang's `cached_tokens_details["storage"]`). A fetch here: the I/O thread
queries storage; the tree books host slots for the hit (`RadixTree.reserve`), the thread reads
the pages into them, the tree adds them as host copies below the request's cached prefix
(`RadixTree.attach`); the request's admission match then finds them in host memory and loads
them like any host hit. `--hicache-storage-prefetch-policy`: `best_effort` admits the request as
soon as its query is answered and takes the pages read by then (the read stops at its next
batch); `wait_complete` waits for every hit page; `timeout` waits up to HiCache's deadline
(`prefetch_timeout_base` + `prefetch_timeout_per_ki_token` per 1024 tokens).

Writes: every prefix that gets a host copy (a device eviction under write_back, the tree's
backup under write_through, a reclaimed donor page moved to host) is written to storage from
there, page by page, once.
"""

from __future__ import annotations

import time
from typing import Any

from radix_ext import HOST

from .cache_tree import namespace_of
from .storage_tier import Fetch, Write

WRITTEN_NODES_MAX = 1 << 20  # forgotten beyond this (a write of known pages is skipped anyway)


def _radix_key(tokens: Any, namespace: Any) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    extra, salt = namespace if namespace is not None else (None, None)
    return RadixKey(list(tokens), extra_key=extra, cache_salt=salt)


class NoStorageHits:
    """A tree without L3: nothing to fetch, nothing written; every node "backed up" (SGLang
    then asks for no hash values), every request's prefetch done at once."""

    pass_prefix_keys = False

    def write(self, node: Any) -> None:
        pass

    def write_nodes(self, nodes: Any) -> None:
        pass

    def spill(self, unrescued: Any, rows: dict, page: int) -> int:
        return 0

    def prefix_hash_values(self, node: Any) -> list:
        return []

    def prefetch(self, request: Any, matched: list, new_tokens: Any, extra_key: Any,
                 cache_salt: Any) -> None:
        pass

    def check_progress(self, request: Any) -> bool:
        return True

    def pop_loaded_tokens(self, request: Any) -> int:
        return 0

    def release_aborted(self, request: Any) -> None:
        pass

    def poll(self) -> None:
        pass

    def reset(self) -> None:
        pass


class StorageHits:
    """L3 below the host tier of the cache's tree: `seat` is the cache's `CacheTree`, `storage`
    a `StorageTier`, `host_kv` the host tier's memory (`HostKV`), `stats` the cache's counters."""

    def __init__(self, seat: Any, storage: Any, host_kv: Any, stats: dict):
        self.seat = seat
        self.storage = storage
        self.host_kv = host_kv
        self.stats = stats
        self.pass_prefix_keys = bool(storage.pass_prefix_keys)
        self._fetches: dict = {}  # request handle -> Fetch
        self._fetched: dict = {}  # request handle -> tokens storage supplied, until popped
        self._written_nodes: set = set()  # ids of tree nodes whose host copy went to storage

    @property
    def tree(self) -> Any:
        return self.seat.tree

    # ---- writes -------------------------------------------------------------------------------

    def write_nodes(self, nodes: Any) -> None:
        """`write` each node (what a reclaim moved into the host tier goes on to L3)."""
        for node in nodes:
            self.write(node)

    def write(self, node: Any) -> None:
        """Write the host copies on the path to `node` to storage (pages not written yet). The
        path's keys are hashed only when one of its host copies was not written before."""
        if node is None or self.tree.is_root(node):
            return
        path = []
        x = node
        while not self.tree.is_root(x):
            path.append(x)
            x = x.parent
        written = self._written_nodes
        if all(x.id in written or HOST not in x.res for x in path):
            return
        if len(written) > WRITTEN_NODES_MAX:
            written.clear()
        ns, tokens = self.tree.prefix_of(node)
        keys = self.storage.page_keys(_radix_key(tokens, ns))
        page, pos = self.seat.page_size, 0
        for x in reversed(path):
            res = x.res.get(HOST)
            n = len(x.key) // page
            if res is not None and x.id not in written:
                self.storage.write(keys[pos:pos + n], res.indices, self.tree.host)
                written.add(x.id)
            pos += n

    def spill(self, unrescued: Any, rows: dict, page: int) -> int:
        """A reclaim's donor copies the host tier found no room for (`Unrescued`, dropped from
        the tree): their staged rows go to storage through the host pool's spill slots
        (`HostKV.reserve_spill`), a spill area's worth of pages per write, each write waited for
        on this (the scheduler) thread, so a later request fetches them from L3 instead of
        prefilling them again. Returns the tokens written; a failed write loses those pages
        only (they are recomputed)."""
        from ..dataplane.reclaim_staging import gather_rows

        slots = self.host_kv.spill_slots
        per = len(slots) // page  # pages per write
        written = 0
        for u in unrescued:
            keys = self.storage.page_keys(_radix_key(u.tokens, u.namespace))
            first, n_pages = u.start // page, (len(u.tokens) - u.start) // page
            if n_pages == 0:
                continue
            ks, vs = gather_rows([(u.src, n_pages * page)], rows, page)
            for p0 in range(0, n_pages, per):
                m = min(per, n_pages - p0)
                at = slice(p0 * page, (p0 + m) * page)
                self.host_kv.write_rows(slots[:m * page], [k[at] for k in ks],
                                        [v[at] for v in vs])
                written += page * self.storage.write_now(keys[first + p0:first + p0 + m],
                                                         slots[:m * page])
        return written

    # ---- the scheduler's L3 calls (through the cache) ------------------------------------------

    def prefix_hash_values(self, node: Any) -> list:
        if self.tree.is_root(node):
            return []
        ns, tokens = self.tree.prefix_of(node)
        return self.storage.page_keys(_radix_key(tokens, ns))

    def prefetch(self, request: Any, matched: list, new_tokens: Any, extra_key: Any,
                 cache_salt: Any) -> None:
        """Look up in storage what continues the request's cached prefix `matched`."""
        if request in self._fetches:
            return
        key = _radix_key(matched + list(new_tokens),
                         None if extra_key is None and cache_salt is None
                         else (extra_key, cache_salt))
        f = self.storage.begin_fetch(request, key, len(matched))
        if f is not None:
            self._fetches[request] = f

    def check_progress(self, request: Any) -> bool:
        """False while the request must wait for its fetch (`--hicache-storage-prefetch-policy`)."""
        f = self._fetches.get(request)
        if f is None:
            return True
        self.poll()
        if request not in self._fetches:
            return True
        policy = self.storage.policy
        waiting = policy == "wait_complete" or (
            policy == "timeout" and time.monotonic() < f.deadline)
        if f.hit_tokens < 0 and policy == "best_effort":
            waiting = True  # best effort still waits for the query's answer
        if waiting:
            return False
        self.storage.terminate(f)  # what is read by its next batch is kept
        return False if f.reading else self._end_fetch(f, 0)

    def pop_loaded_tokens(self, request: Any) -> int:
        return self._fetched.pop(request, 0)

    def release_aborted(self, request: Any) -> None:
        f = self._fetches.get(request)
        if f is not None:
            f.abandoned = True
            self.storage.terminate(f)  # its pages still join the tree when read
        self._fetched.pop(request, None)

    # ---- progress (scheduler thread) ----------------------------------------------------------

    def reset(self) -> None:
        """Stop every fetch, wait for the I/O in flight and settle it (before the tree is
        replaced): afterwards no thread reads or writes a host slot of this tree."""
        for f in self._fetches.values():
            f.abandoned = True
            self.storage.terminate(f)
        self.storage.drain()
        self.poll()
        for f in list(self._fetches.values()):  # queries answered after the drain's poll
            self._end_fetch(f, 0)
        self._written_nodes.clear()  # node ids start again in the new tree

    def poll(self) -> None:
        """Settle what the I/O threads finished (every scheduler loop)."""
        self.stats["l3_failures"] = self.storage.failures
        for item in self.storage.poll():
            if type(item) is Write:
                self.tree.host.release(item.held)
                self.stats["l3_written_pages"] += item.ok_pages
            elif item.reading:
                self._attach(item)
            else:
                self._hit_known(item)

    def _hit_known(self, f: Fetch) -> None:
        """The query answered: book host slots for the hit and start reading, or end."""
        if f.hit_tokens <= 0 or f.op.is_terminated():
            self._end_fetch(f, 0)
            return
        got = self.tree.reserve(HOST, f.hit_tokens)
        if got is None:  # no host room (everything pinned): the request recomputes
            self._end_fetch(f, 0)
            return
        import torch

        rid, res, _ = got
        self.storage.read(f, rid, torch.frombuffer(res.indices, dtype=torch.int64).clone())

    def _attach(self, f: Fetch) -> None:
        key = f.key
        n = self.tree.attach(f.rid, key.raw_token_ids(), f.start, f.op.completed_tokens,
                             namespace_of(key))
        self.stats["l3_fetched_tokens"] += n
        self._end_fetch(f, n)

    def _end_fetch(self, f: Fetch, tokens: int) -> bool:
        if self._fetches.get(f.handle) is f:
            del self._fetches[f.handle]
            if tokens and not f.abandoned:
                self._fetched[f.handle] = tokens
        return True
