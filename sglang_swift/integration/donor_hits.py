"""Lower-tier hits of `SwiftRadixCache` (a collaborator built before it, `build.py`): donor
and host hits offered to SGLang's admission and streamed under the forward (`streaming.py`), or,
when the donor tier is full, swapped in place with device victims (the exchange, streamed under
the forward too); demotions beside the scheduler (`demotion.py`); write-through host copies.

`DonorHits` serves a tree with a donor tier, a host tier or both; a tree with neither gets
`NoDonorHits`: no lower-tier hit, radix_ext's own eviction (the decisions of SGLang's LRU tree).
"""

from __future__ import annotations

import logging
from array import array
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

from radix_ext import HOST, DevicePool, RadixTree, admission
from radix_ext.residency import DonorResidency

logger = logging.getLogger(__name__)

# A forward waits for its batch's donor loads at most this long after the batch started, plus
# the loaded bytes at LOAD_MIN_BYTES_PER_S; then the loads still running fail and their requests
# are aborted (never answered from incomplete KV). A copy runs at memory or link bandwidth
# (GB/s; docs/streaming.md), so only a copy thread starved far beyond that, or a broken engine,
# ever reaches it: it bounds the scheduler thread's wait whatever a donor does.
LOAD_WAIT_FLOOR_S = 2.0
LOAD_MIN_BYTES_PER_S = 256 << 20


def path_key(tree: RadixTree, node: Any) -> Optional[tuple[array, Any]]:
    """The tokens and namespace of the path from the root to `node`; None once `node` left
    the tree (dropped, or split away from the path a match reported)."""
    parts = []
    x = node
    while x is not tree.root:
        parent = x.parent
        if parent is None or parent.children.get(x.ck) is not x:
            return None
        parts.append(x.key)
        top, x = x, parent
    if not parts:
        return None
    key = array("q")
    for part in reversed(parts):
        key.extend(part)
    return key, top.ck[0]  # a child of the root is keyed (namespace, first page)


class DemotingSlots(DevicePool):
    """The device slots as admission sees them in a cache with lower tiers: room is made by
    demotions, their stores copied (CPU) or enqueued (GPU) before it returns."""

    def __init__(self, slots: Any, demotions: Any):
        self.slots = slots  # cache_tree.KVSlots
        self.demotions = demotions

    def available(self) -> int:
        return self.slots.available()

    def alloc(self, num_tokens: int) -> Optional[torch.Tensor]:
        return self.slots.alloc(num_tokens)

    def free(self, indices: Any) -> None:
        self.slots.free(indices)

    def make_room(self, tree: Any, num_tokens: int) -> int:
        return self.demotions.make_room(num_tokens)


class NoDonorHits:
    """A tree without donor or host tier: no lower-tier hit, nothing to load or demote; room is
    made by radix_ext's eviction, as SGLang's own LRU tree makes it."""

    def __init__(self, seat: Any):
        self.seat = seat  # cache_tree.CacheTree

    def lower_hit(self, m: Any) -> tuple[int, Any]:
        return 0, m.last_device_node

    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any]:
        return 0, params.req.last_node

    def load_back_is_cache_owned(self) -> bool:
        return False

    def private_slots(self, rid: Any) -> None:
        return None

    def make_room(self, num_tokens: int) -> int:
        return self.seat.slots.make_room(self.seat.tree, num_tokens)

    def inserted(self, node: Any) -> None:
        pass

    def batch_built(self, batch: Any) -> None:
        pass

    def batch_ran(self, scheduler: Any, batch: Any) -> None:
        pass

    def requeue(self, scheduler: Any) -> None:
        pass

    def poll(self) -> None:
        pass

    def reset(self) -> None:
        pass


def follow_forward(device: Any, tp_worker: Any) -> None:
    """Order this server's copy lanes after the stream its model's forward runs on (touch point
    FORWARD_STREAM; docs/streaming.md "Ordering against SGLang's forward stream"). A CPU pool
    has no such stream: its lanes are host threads, ordered by the scheduler thread itself."""
    from ..dataplane import streams

    runner = getattr(tp_worker, "model_runner", None)
    stream = getattr(runner, "forward_stream", None)
    if torch.device(device).type == "cuda" and stream is not None:
        streams.follow_forward_stream(device, stream)


class DonorHits:
    """Lower-tier hits of a tree with a donor tier, a host tier or both (see the module
    docstring). `seat` is the cache's `CacheTree`; `runtime` its `SwiftRuntime` (a
    `runtime.NoRuntime` with a host tier alone); `stats` the cache's counters; `host_kv` the
    host tier's memory (`host_tier.HostKV`) or None without one; `storage` the cache's
    `StorageHits` (what reaches host goes on to L3). The layer counter goes where SGLang's own
    HiCache puts its: the pool's buffer getters wait on it per layer, and the tp worker hands
    it each batch's consumer index before the forward."""

    def __init__(self, seat: Any, runtime: Any, stats: dict, *, kv_pool: Any, tp_worker: Any,
                 storage: Any, host_kv: Any = None):
        from ..dataplane import make_layer_counter
        from ..dataplane.pool_lease import pool_buffers, pool_device
        from .demotion import Demotions
        from .layer_fan_in import TimedLayerCounter
        from .load_retry import LoadRetries
        from .streaming import StreamingLoads

        if tp_worker is None:
            raise ValueError("a borrowing SwiftCache server needs SGLang's tp worker to register "
                             "its layer counter; build the cache through the backend factory")
        device = pool_device(kv_pool)
        self.counter = TimedLayerCounter(make_layer_counter(
            kv_pool.layer_num, device, timeout_s=LOAD_WAIT_FLOOR_S))
        kv_pool.register_layer_transfer_counter(self.counter)
        tp_worker.register_hicache_layer_transfer_counter(self.counter)
        follow_forward(device, tp_worker)
        token_bytes = sum(buf[0].numel() * buf.element_size()  # an MLA pool: no V buffers
                          for half in pool_buffers(kv_pool) for buf in half)
        self.seat = seat
        self.runtime = runtime
        self.stats = stats
        self.storage = storage
        self.host_kv = host_kv  # host_tier.HostKV, or None: no host tier
        self.loads = StreamingLoads(seat, runtime, self.counter, stats,
                                    wait_budget=lambda tokens: LOAD_WAIT_FLOOR_S + (
                                        tokens * token_bytes / LOAD_MIN_BYTES_PER_S),
                                    host_kv=host_kv)
        self.retries = LoadRetries(stats)
        self.demotions = Demotions(seat, runtime, stats, host_kv=host_kv, storage=storage)
        self.slots = DemotingSlots(seat.slots, self.demotions)
        self._owned_load = False  # the last init_load_back gave the request a tree-owned prefix

    # ---- the cache's calls --------------------------------------------------------------------

    def make_room(self, num_tokens: int) -> int:
        """Evict for SGLang's allocator: demotions, stored before this returns."""
        return self.demotions.make_room(num_tokens)

    def batch_built(self, batch: Any) -> None:
        """A prefill batch was built: start the loads its requests queued."""
        self.loads.start(batch)

    def batch_ran(self, scheduler: Any, batch: Any) -> None:
        """A batch's forward ran: drop the output of requests whose load failed, and send
        those that can run again back towards the waiting queue (`load_retry.py`)."""
        self.loads.settle(scheduler, batch)
        self.retries.take(scheduler, batch, self.loads.take_failed())

    def requeue(self, scheduler: Any) -> None:
        """Before the next batch is chosen: retried requests re-enter the waiting queue."""
        self.retries.requeue(scheduler)

    def poll(self) -> None:
        """Close finished copies (every scheduler loop)."""
        self.demotions.poll()
        self.loads.poll()
        self.stats["layer_wait_s"] = self.counter.wait_s

    def reset(self) -> None:
        """The tree was replaced: the tickets in flight go with the old one."""
        self.loads.reset()
        self.demotions.reset()

    def private_slots(self, rid: Any) -> Optional[torch.Tensor]:
        """A request's loaded slots, not the tree's until its forward confirmed them."""
        return self.loads.private_slots(rid)

    def inserted(self, node: Any) -> None:
        """The tree took computed KV up to `node`: under write_through, its host copies,
        through SGLang's host pool on the scheduler's stream (GPU: ordered before anything that
        could rewrite the device rows, no host wait; CPU: copied here). A copy that fails is
        taken back: the prefix is then on the device only, as under write_back."""
        if self.host_kv is None or not self.host_kv.write_through:  # write_back: at eviction
            return
        transfers, _ = self.seat.tree.back_up(node, HOST)
        if not transfers:
            return
        try:
            self.stats["host_stored_tokens"] += self.host_kv.store_copies(transfers)
        except Exception:  # noqa: BLE001 - the host copy is an optimisation; the device has it
            logger.exception("SwiftCache: a write-through copy into the host tier failed")
            self.seat.tree.forget_backup(transfers)
            return
        self.storage.write(node)

    # ---- hits ---------------------------------------------------------------------------------

    def lower_hit(self, m: Any) -> tuple[int, Any]:
        """The part of match `m` below the device that SGLang may load (donor and host
        segments): up to its first donor segment whose lease is not readable now; (tokens,
        deepest node), or (0, last device node)."""
        hit, best = 0, m.last_device_node
        for seg in m.loads:
            if not self._readable(seg.source):
                self.stats["hits_unreadable"] += 1
                break
            hit, best = hit + seg.num_tokens, seg.node
        return hit, best

    def _readable(self, res: Any) -> bool:
        """Whether residency `res` below the device can be read now: a host one always; a
        donor one while its lease is held, within its read deadline, its blocks not reclaimed
        (fenced) since, and the donor process is there (a donor killed or a reclaim since is a
        recompute, not a failed load)."""
        if type(res) is not DonorResidency:
            return True
        return self.runtime.readable(res.donor, res.lease, res.blocks)

    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any]:
        """Admit the load of a matched donor part (SGLang calls this for admitted requests):
        allocate its slots (demoting for them: `Demotions.make_room`), begin the tree's ticket
        and queue the copy for the batch. All or nothing: (host_hit_length, last node) when
        queued; (0, last node) to recompute.

        The room for the request's new tokens is made here too, so that allocating them in
        `prepare_for_extend` (which cannot wait for a store) finds it free."""
        req = params.req
        fallback = (0, req.last_node)
        self._owned_load = False
        if params.host_hit_length <= 0:
            return fallback
        tree, slots = self.seat.tree, self.slots
        found = path_key(tree, params.best_match_node)
        if found is None:
            return self._decline(req, "the matched node left the tree")
        extend = len(req.full_untruncated_fill_ids) - req.prefix_len - params.host_hit_length
        need = params.host_hit_length + max(0, extend) + self.seat.page_size
        if slots.available() < need:
            swapped = self._exchange(req, found, params.host_hit_length, need)
            if swapped is not None:
                return swapped
            # the room's demotions must not push the very prefix being loaded out of the donor
            # tier (it is the oldest there when its conversation comes back)
            with admission.holding(tree.match(found[0], found[1])):
                self.demotions.make_room(need - slots.available())
        a = admission.admit(tree, slots, found[0], found[1])
        if not a.ok:
            return self._decline(req, "no room for the load")
        ticket = a.load
        unreadable = ticket is not None and not all(self._readable(c.src) for c in ticket.copies)
        if ticket is not None and (unreadable or a.match.last_device_node is not req.last_node
                                   or len(ticket.device_indices) != params.host_hit_length):
            slots.free(tree.abort_load_back(ticket).device_indices_to_free)
            ticket = None  # the tree or a donor changed since the match: recompute
            # a donor gone, past its read deadline or fenced by a reclaim: refused, not failed
            self.stats["refused_loads"] += int(unreadable)
        tree.unlock(a.anchor)
        if ticket is None:
            return self._decline(req, "the match or its donor changed since")
        self.loads.queue(req, ticket, self.seat.device)
        for c in ticket.copies:  # hits by the tier they load from
            self.stats[f"{c.src_tier}_hit_tokens"] += len(c.dst.indices)
        return len(ticket.device_indices), req.last_node

    def _exchange(self, req: Any, found: tuple, hit_len: int,
                  need: int) -> Optional[tuple[int, Any]]:
        """Swap the donor hit with device victims (`RadixTree.begin_exchange`) when the room for
        it would push other prefixes out of a full donor tier (`admission.should_exchange`). The
        tree records the swap now and keeps both sides out of every other match; the copy is
        queued like a load (`StreamingLoads.queue_exchange`): it runs layer by layer under the
        request's forward and settles after it. The hit is on the device and the tree's:
        SGLang is told so through `load_back_is_cache_owned`, and the room for the request's
        new tokens is made with the hit held. None: not applicable here (the caller loads as
        usual); else what `init_load_back` returns."""
        if self.runtime.tp is not None:  # a swap is one rank's: not with TP
            return None
        tree, slots = self.seat.tree, self.slots
        m = tree.match(found[0], found[1])
        if (m.last_device_node is not req.last_node or m.load_len != hit_len
                or not admission.should_exchange(tree, m, need - slots.available())
                or not all(self._readable(seg.source) for seg in m.loads)):
            return None
        ticket = tree.begin_exchange(m)
        if ticket is None:
            return None
        self.loads.queue_exchange(req, ticket, self.seat.device)
        rest = need - ticket.num_tokens
        if slots.available() < rest:
            tree.lock(ticket.last_node)
            try:
                self.demotions.make_room(rest - slots.available())
            finally:
                tree.unlock(ticket.last_node)
        self._owned_load = True
        return ticket.num_tokens, ticket.last_node

    def _decline(self, req: Any, why: str) -> tuple[int, Any]:
        """Recompute instead of loading (SGLang re-plans the request without the donor part)."""
        self.stats["loads_declined"] += 1
        logger.info("SwiftCache: request %s recomputes its donor hit: %s", req.rid, why)
        return 0, req.last_node

    def load_back_is_cache_owned(self) -> bool:
        """Whether the last `init_load_back` (SGLang asks right after it) gave the request a
        prefix the tree owns: True after an exchange, whose hit is device-resident in the tree
        (on the victims' slots, swapped under the forward) and locked by the request like any
        device prefix. Streamed loads are not: their slots belong to the request until its
        forward confirmed them (it then inserts them like computed KV); a failed load is freed
        with the request."""
        return self._owned_load
