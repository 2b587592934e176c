"""The borrower's side of `SwiftRadixCache`: donor hits offered to SGLang's admission and
streamed under the forward (`streaming.py`), or, when the donor tier is full, swapped in place
with device victims (the exchange, streamed under the forward too), demotions beside the
scheduler (`demotion.py`).

A mixin of the cache class (it uses the cache's tree, slots, runtime and device); every method
here is a no-op or the stock behaviour while the server does not borrow (`self.loads` is None).
"""

from __future__ import annotations

import logging
from array import array
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

from radix_ext import RadixTree, admission
from radix_ext.residency import DonorResidency

from .work_clock import timed

logger = logging.getLogger(__name__)

# A forward waits for its batch's donor loads at most this long after the batch started, plus
# the loaded bytes at LOAD_MIN_BYTES_PER_S; then the loads still running fail and their requests
# are aborted (never answered from incomplete KV). A copy is memory bandwidth on this host (5.8
# GB/s measured on the 2-core CI machine, docs/streaming.md), so only a copy thread starved far
# beyond that, or a broken engine, ever reaches it: it bounds the scheduler thread's wait
# whatever a donor does.
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


class DonorHitsMixin:
    """Mixed into `SwiftRadixCache`; see the module docstring."""

    _owned_load = False  # the last init_load_back gave the request a tree-owned prefix

    def _start_streaming(self, config: Any, kv_pool: Any, tp_worker: Any) -> None:
        """Loads under the forward and stores beside the scheduler. The counter goes where
        SGLang's own HiCache puts its: the pool's buffer getters wait on it per layer, and the
        tp worker hands it each batch's consumer index before the forward."""
        from ..dataplane import make_layer_counter
        from .demotion import Demotions
        from .layer_fan_in import TimedLayerCounter
        from .streaming import StreamingLoads

        if tp_worker is None:
            raise ValueError("a borrowing SwiftCache server needs SGLang's tp worker to register "
                             "its layer counter; build the cache through the backend factory")
        self.counter = TimedLayerCounter(make_layer_counter(
            kv_pool.layer_num, kv_pool.k_buffer[0].device, timeout_s=LOAD_WAIT_FLOOR_S))
        kv_pool.register_layer_transfer_counter(self.counter)
        tp_worker.register_hicache_layer_transfer_counter(self.counter)
        token_bytes = sum(buf[0].numel() * buf.element_size()
                          for buf in (*kv_pool.k_buffer, *kv_pool.v_buffer))
        self.loads = StreamingLoads(self, self.runtime, self.counter, self.stats,
                                    wait_budget=lambda tokens: LOAD_WAIT_FLOOR_S + (
                                        tokens * token_bytes / LOAD_MIN_BYTES_PER_S),
                                    host_kv=self.host_kv)
        self.demotions = Demotions(self, self.runtime, self.stats, host_kv=self.host_kv)

    @timed("batch_start")
    def swift_batch_built(self, batch: Any) -> None:
        """A prefill batch was built (plugin hook): start the loads its requests queued."""
        if self.loads is not None:
            self.loads.start(batch)

    @timed("batch_settle")
    def swift_batch_ran(self, scheduler: Any, batch: Any) -> None:
        """A batch's forward ran (plugin hook): drop the output of requests whose load failed."""
        if self.loads is not None:
            self.loads.settle(scheduler, batch)

    def _lower_hit(self, m: Any) -> tuple[int, Any]:
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

    @timed("load_back")
    def init_load_back(self, params: InitLoadBackParams) -> Optional[tuple[int, Any]]:
        """Admit the load of a matched donor part (SGLang calls this for admitted requests):
        allocate its slots (demoting for them: `Demotions.make_room`), begin the tree's ticket
        and queue the copy for the batch. All or nothing: (host_hit_length, last node) when
        queued; (0, last node) to recompute.

        The room for the request's new tokens is made here too, so that allocating them in
        `prepare_for_extend` (which cannot wait for a store) finds it free."""
        req = params.req
        fallback = (0, req.last_node)
        self._owned_load = False
        if self.loads is None or params.host_hit_length <= 0:
            return fallback
        found = path_key(self.tree, params.best_match_node)
        if found is None:
            return self._decline(req, "the matched node left the tree")
        extend = len(req.full_untruncated_fill_ids) - req.prefix_len - params.host_hit_length
        need = params.host_hit_length + max(0, extend) + self.page_size
        if self.slots.available() < need:
            swapped = self._exchange(req, found, params.host_hit_length, need)
            if swapped is not None:
                return swapped
            # the room's demotions must not push the very prefix being loaded out of the donor
            # tier (it is the oldest there when its conversation comes back)
            with admission.holding(self.tree.match(found[0], found[1])):
                self.demotions.make_room(need - self.slots.available())
        a = admission.admit(self.tree, self.slots, found[0], found[1])
        if not a.ok:
            return self._decline(req, "no room for the load")
        ticket = a.load
        unreadable = ticket is not None and not all(self._readable(c.src) for c in ticket.copies)
        if ticket is not None and (unreadable or a.match.last_device_node is not req.last_node
                                   or len(ticket.device_indices) != params.host_hit_length):
            self.slots.free(self.tree.abort_load_back(ticket).device_indices_to_free)
            ticket = None  # the tree or a donor changed since the match: recompute
            # a donor gone, past its read deadline or fenced by a reclaim: refused, not failed
            self.stats["refused_loads"] += int(unreadable)
        self.tree.unlock(a.anchor)
        if ticket is None:
            return self._decline(req, "the match or its donor changed since")
        self.loads.queue(req, ticket, self.device)
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
        if getattr(self.runtime, "tp", None) is not None:  # a swap is one rank's: not with TP
            return None
        m = self.tree.match(found[0], found[1])
        if (m.last_device_node is not req.last_node or m.load_len != hit_len
                or not admission.should_exchange(self.tree, m, need - self.slots.available())
                or not all(self._readable(seg.source) for seg in m.loads)):
            return None
        ticket = self.tree.begin_exchange(m)
        if ticket is None:
            return None
        self.loads.queue_exchange(req, ticket, self.device)
        rest = need - ticket.num_tokens
        if self.slots.available() < rest:
            self.tree.lock(ticket.last_node)
            try:
                self.demotions.make_room(rest - self.slots.available())
            finally:
                self.tree.unlock(ticket.last_node)
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
        device prefix. Streamed loads are not: their slots
        belong to the request until its forward confirmed them (it then inserts them like
        computed KV); a failed load is freed with the request."""
        return self._owned_load

    def prefix_device_indices(self, req: Any) -> torch.Tensor:
        path = self.path_device_indices(req.last_node)
        tail = self.loads.private_slots(req.rid) if self.loads is not None else None
        if tail is not None:
            path = torch.cat([path, tail])
        assert len(path) >= req.prefix_len, (req.rid, len(path), req.prefix_len)
        return path[: req.prefix_len]
