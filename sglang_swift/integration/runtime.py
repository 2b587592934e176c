"""SwiftRuntime: one per SwiftCache server, in its scheduler process, beside the scheduler loop.

It ties the three components together for a live SGLang server:
- the control agent (`control/`), which finds the other SwiftCache servers on the node;
- as a donor, a shared arena (`dataplane/`) of `lend_fraction` of the server's KV capacity,
  offered to borrowers and taken back (reclaim) when the server's own KV usage passes
  `reclaim_watermark`;
- as a borrower, leases of donor blocks, mapped from each grant's descriptor and handed to the
  radix tree's donor tier, plus the copies the tree asks for (store on demotion, load on a hit).

Threading: the agent runs its own I/O thread; everything here runs on the scheduler thread, which
calls `pump()` once per loop iteration (`SwiftRadixCache.swift_step`, from the plugin's hook).
Faults are expected events: a lost or reclaiming donor is revoked from the tree before the reclaim
is acknowledged, and a copy from a donor whose read deadline passed is refused (the tree's store
or load ticket is then aborted), so the request recomputes instead of reading blocks that may
already hold someone else's data.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .swift_config import SwiftConfig
from ..control import (BlocksReturned, ControlAgent, ControlConfig, LeaseGranted, LeaseKey,
                      LeaseLost, PeerChanged, ReclaimRequested, RequestFailed)
from ..dataplane import (KVGeometry, MappingError, SharedArena, TransferEngine, block_bytes_for,
                        map_arena, owner_alive, unlink_descriptor)

logger = logging.getLogger(__name__)


def geometry_of(kv_pool: Any, page_size: int) -> KVGeometry:
    """The KV geometry of SGLang's MHATokenToKVPool (one TP rank), one page per block."""
    return KVGeometry(num_layers=kv_pool.layer_num, num_kv_heads=kv_pool.head_num,
                      head_dim=kv_pool.head_dim,
                      v_head_dim=getattr(kv_pool, "v_head_dim", kv_pool.head_dim),
                      dtype=kv_pool.store_dtype, page_size=page_size)


def control_config_for(config: SwiftConfig, agent_id: str) -> ControlConfig:
    return ControlConfig(agent_id=agent_id, rendezvous_dir=config.resolved_rendezvous_dir(),
                         secret_file=config.resolved_secret_file(),
                         heartbeat_interval_s=config.heartbeat_interval_s,
                         heartbeat_timeout_s=config.heartbeat_timeout_s,
                         lease_margin_s=min(0.25, config.heartbeat_timeout_s / 4))


@dataclass
class BorrowedLease:
    """A lease this server borrows. The tree numbers its blocks 0..n-1 (lease-local);
    `arena_blocks[i]` is the donor arena's block id of local block i, fixed for the lease's life.
    `gone` holds the local blocks the donor took back."""

    key: LeaseKey
    arena_blocks: list[int]
    engine: TransferEngine
    local: dict[int, int] = field(default_factory=dict)  # arena block id -> lease-local index
    gone: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.local = {b: i for i, b in enumerate(self.arena_blocks)}

    @property
    def held(self) -> int:
        return len(self.arena_blocks) - len(self.gone)


class SwiftRuntime:
    """The live side of SwiftCache in one server; see the module docstring for the contract."""

    def __init__(self, config: SwiftConfig, *, model: str, kv_pool: Any, allocator: Any,
                 tree: Any, page_size: int, agent_id: str | None = None) -> None:
        self.config = config
        self.kv_pool = kv_pool
        self.allocator = allocator
        self.tree = tree
        self.geometry = geometry_of(kv_pool, page_size)
        self.device = kv_pool.k_buffer[0].device
        self.agent_id = agent_id or f"{os.path.basename(model.rstrip('/')) or 'model'}-{os.getpid()}"
        self.agent = ControlAgent(control_config_for(config, self.agent_id), model=model)
        self.arena: SharedArena | None = None
        self.withheld: set[int] = set()  # donor: blocks reclaimed for the server's own demand
        self.leases: dict[tuple[str, int], BorrowedLease] = {}  # (donor, lease id) -> held lease
        self._mapped: dict[str, Any] = {}  # donor owner_uuid -> MappedArena
        self._requested = False
        self.stats = {"stored_tokens": 0, "loaded_tokens": 0, "refused_loads": 0,
                      "refused_stores": 0, "revoked_tokens": 0, "leases": 0, "reclaims": 0,
                      "lost_leases": 0}

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> "SwiftRuntime":
        if self.config.lends:
            blocks = int(self.allocator.size * self.config.lend_fraction) // self.geometry.page_size
            if blocks > 0:
                self.arena = SharedArena(blocks, block_bytes_for(self.geometry),
                                         device=str(self.device))
                self.agent.set_memory(self.arena.export())
                self.agent.offer(list(range(blocks)))
        self.agent.start()
        logger.info("SwiftCache runtime %s started: lends %d blocks, borrows up to %d",
                    self.agent_id, self.arena.num_blocks if self.arena else 0,
                    self.config.max_borrow_blocks if self.config.borrows else 0)
        return self

    def stop(self) -> None:
        self.agent.stop()
        for held in self.leases.values():
            held.engine.close()
        for m in self._mapped.values():
            m.close()
        self.leases.clear()
        self._mapped.clear()
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    # ---- the scheduler thread's step ------------------------------------------------------
    def pump(self) -> None:
        """Handle what the agent queued; ask for leases; enforce the donor watermark."""
        for event in self.agent.poll_events():
            handler = self._handlers.get(type(event))
            if handler is not None:
                handler(self, event)
        if self.config.borrows and not self._requested and self._peer_count() > 0:
            want = self.config.max_borrow_blocks - self._held_blocks()
            if want > 0:
                self.agent.request(want)
                self._requested = True
        if self.arena is not None:
            self._enforce_watermark()

    def _peer_count(self) -> int:
        return len(self.agent.status().peers)

    def _held_blocks(self) -> int:
        return sum(h.held for h in self.leases.values())

    def attach_tree(self, tree: Any) -> None:
        """The cache was reset (a new, empty tree): register the leases still held in it."""
        self.tree = tree
        for held in self.leases.values():
            k = held.key
            tree.donor.add_lease(k.donor, k.lease_id, k.epoch, len(held.arena_blocks))
            if held.gone:
                tree.donor.remove_blocks(k.donor, k.lease_id, held.gone)

    def own_usage(self) -> float:
        """Share of this server's KV pool in use by live requests (the tree's evictable part is
        reclaimable, so it does not count as demand)."""
        free = self.allocator.available_size() + self.tree.evictable_size()
        return 1.0 - free / max(1, self.allocator.size)

    def _enforce_watermark(self) -> None:
        if self.own_usage() > self.config.reclaim_watermark:
            lent = self.arena.num_blocks - len(self.withheld)
            if lent > 0:
                self.agent.demand(lent)
        elif self.withheld and self.own_usage() < self.config.reclaim_watermark * 0.8:
            self.agent.offer(sorted(self.withheld))
            self.withheld.clear()

    # ---- events -----------------------------------------------------------------------------
    def _on_granted(self, ev: LeaseGranted) -> None:
        self._requested = False
        try:
            mapped = self._mapped.get(ev.memory.owner_uuid)
            if mapped is None:
                mapped = map_arena(ev.memory, self.geometry)
                self._mapped[ev.memory.owner_uuid] = mapped
            engine = TransferEngine(mapped.memory, self.geometry, liveness=mapped.alive)
        except MappingError as exc:  # an expected event: give the blocks back, run without them
            logger.warning("SwiftCache: cannot map donor %s (%s); releasing the lease",
                           ev.key.donor, exc)
            self.agent.release(ev.key)
            return
        held = BorrowedLease(ev.key, list(ev.blocks), engine)
        self.leases[(ev.key.donor, ev.key.lease_id)] = held
        self.tree.donor.add_lease(ev.key.donor, ev.key.lease_id, ev.key.epoch, len(ev.blocks))
        self.stats["leases"] += 1
        logger.info("SwiftCache: borrowing %d blocks from %s (lease %d, epoch %d)",
                    len(ev.blocks), ev.key.donor, ev.key.lease_id, ev.key.epoch)

    def _on_failed(self, ev: RequestFailed) -> None:
        self._requested = False
        logger.info("SwiftCache: lease request to %s failed: %s", ev.donor, ev.reason)

    def _on_reclaim(self, ev: ReclaimRequested) -> None:
        held = self.leases.get((ev.key.donor, ev.key.lease_id))
        if held is not None:
            local = [held.local[b] for b in ev.blocks
                     if b in held.local and held.local[b] not in held.gone]
            # revoke drops every residency on those blocks and takes them out of the tier
            self.forget(self.tree.revoke(ev.key.donor, lease_id=ev.key.lease_id, blocks=local))
            held.gone.update(local)
        self.stats["reclaims"] += 1
        logger.info("SwiftCache: %s reclaimed %d blocks of lease %d", ev.key.donor,
                    len(ev.blocks), ev.key.lease_id)
        self.agent.ack_reclaim(ev)  # only after the tree stopped referencing those blocks

    def _on_lost(self, ev: LeaseLost) -> None:
        held = self.leases.pop((ev.key.donor, ev.key.lease_id), None)
        if held is None:
            return
        self.forget(self.tree.revoke(ev.key.donor, lease_id=ev.key.lease_id))
        held.engine.close()
        self.stats["lost_leases"] += 1
        self._drop_dead_mappings()
        logger.warning("SwiftCache: lease %s lost (%s); its prefixes will be recomputed",
                       ev.key, ev.reason)

    def _drop_dead_mappings(self) -> None:
        """Unmap arenas whose donor process is gone; a donor killed with SIGKILL could not
        unlink its shared memory, so the last borrower to notice does."""
        for uuid, mapped in list(self._mapped.items()):
            if not owner_alive(mapped.descriptor["owner_pid"]):
                desc = mapped.descriptor
                mapped.close()
                del self._mapped[uuid]
                unlink_descriptor(desc)

    def _on_returned(self, ev: BlocksReturned) -> None:
        self.withheld.update(ev.blocks)

    def _on_peer(self, ev: PeerChanged) -> None:
        logger.info("SwiftCache: peer %s %s %s", ev.agent_id,
                    "joined" if ev.joined else "lost", ev.reason)

    _handlers = {LeaseGranted: _on_granted, RequestFailed: _on_failed,
                 ReclaimRequested: _on_reclaim, LeaseLost: _on_lost,
                 BlocksReturned: _on_returned, PeerChanged: _on_peer}

    def forget(self, result: Any) -> None:
        """Account a tree revoke. It releases no device slot (device residency is prefix-closed,
        so a subtree that lost its last copy was already off the device), and stores or loads it
        made stale fail when their holder settles them."""
        self.stats["revoked_tokens"] += result.num_tokens_lost

    # ---- copies the tree asks for ---------------------------------------------------------
    def store(self, items: Sequence[tuple[Sequence[int], Any]]) -> list[bool]:
        """Copy each (device slots, donor residency) pair into its donor blocks, in order.

        Consecutive pairs on one lease go in one transfer (one pass over the layers) unless a
        block repeats, which keeps the plan's order where a later copy reuses a block. Returns,
        per pair, whether its copy happened (False: the donor is gone or too late to write; the
        caller aborts that store, which leaves the lease as it was)."""
        done = [False] * len(items)
        for key, idxs in _batches(items, lambda item: item[1]):
            ok = self._copy(key, [items[i][0] for i in idxs], [items[i][1] for i in idxs], None)
            self.stats["refused_stores"] += 0 if ok else 1
            for i in idxs:
                done[i] = ok
        return done

    def load(self, items: Sequence[tuple[Any, Sequence[int]]], counter: Any) -> bool:
        """Copy each (donor residency, device slots) pair back, layer by layer, signalling
        `counter`; False (treat every slot as garbage) if any copy could not run."""
        for key, idxs in _batches(items, lambda item: item[0]):
            if not self._copy(key, [items[i][1] for i in idxs], [items[i][0] for i in idxs],
                              counter):
                self.stats["refused_loads"] += 1
                return False
        return True

    def _copy(self, key: tuple[str, int], slot_lists: list, residencies: list, counter) -> bool:
        held = self.leases.get(key)
        if held is None or not self._readable(key[0]):
            return False
        slots = torch.as_tensor([s for lst in slot_lists for s in lst], dtype=torch.int64)
        blocks = [held.arena_blocks[b] for r in residencies for b in r.blocks]
        k, v = self.kv_pool.k_buffer, self.kv_pool.v_buffer
        handle = (held.engine.begin_store(k, v, slots, blocks) if counter is None
                  else held.engine.begin_load(k, v, slots, blocks, counter))
        if not handle.wait(self.config.heartbeat_timeout_s * 4).ok:
            return False
        self.stats["stored_tokens" if counter is None else "loaded_tokens"] += len(slots)
        return True

    def _readable(self, donor: str) -> bool:
        return time.monotonic() < self.agent.read_deadline(donor)


def _batches(items: Sequence, residency_of) -> list[tuple[tuple[str, int], list[int]]]:
    """Split `items` (in order) into runs on one lease with no block repeated within a run."""
    runs: list[tuple[tuple[str, int], list[int]]] = []
    seen: set[int] = set()
    for i, item in enumerate(items):
        res = residency_of(item)
        key = (res.donor, res.lease)
        if not runs or runs[-1][0] != key or seen.intersection(res.blocks):
            runs.append((key, []))
            seen = set()
        runs[-1][1].append(i)
        seen.update(res.blocks)
    return runs
