"""SwiftRuntime: one per SwiftCache server, in its scheduler process, beside the scheduler loop.

It ties the components together for a live SGLang server:
- the control agent (`control/`), which finds the other SwiftCache servers on the node;
- as a donor, a `PoolLender` (lending.py): idle pages of this server's own SGLang KV pool (placed
  in shareable memory by `shared_kv_pool.py`) are offered to borrowers and freed back into the
  allocator once returned, so capacity moves between models;
- as a borrower, a `Borrowing` (dataplane/borrowing.py): leases of other servers' pool pages,
  packed for this model's shape, handed to the radix tree's donor tier, plus the copies the tree
  asks for.
A role the server does not have is a null object (`NoLender`, `NoBorrowing`).

Threading: the agent runs its own I/O thread; everything here runs on the scheduler thread, which
calls `lend()` every loop iteration and `pump()` at most every 20 ms (`SwiftRadixCache.swift_step`,
from the plugin's hook), except `_fence_reclaim`, which the agent calls on its I/O thread.
Faults are expected events. A reclaim is acknowledged from the agent's thread as soon as no copy
touches the reclaimed pages (`Borrowing.fence`), so a donor never waits for this server's forward
pass; the tree forgets the blocks at the next pump, and until then every copy touching them is
refused. A lost lease is revoked from the tree at the pump. A copy from a donor that is not
readable now is refused (the tree's ticket is aborted), so the request recomputes instead of
reading pages that may already hold the donor's own data.

With `--tp > 1` (`tp`, `tp_sync.py`) every rank has a runtime and only rank 0 an agent (the
others a `FollowerAgent`): rank 0 shares its agent's events and its view of the leases at each
pump, every rank applies them at the same step, a reclaim is fenced by every rank at that pump
and acknowledged by rank 0 only after all of them (no acknowledgement from the agent's thread:
the other ranks' copies are in other processes), and each rank copies its own shard of the KV
heads (`LeasePacking(shard=)`). Rank 0's agent wakes rank 0's scheduler loop when it queued an
event that waits for the pump (`WAKE_EVENTS`, `loop_wake.py`): an idle scheduler asleep in SGLang's
`--sleep-on-idle` poll runs its loop at once and the pump it runs is due, so an idle TP borrower
acknowledges a reclaim within a loop. A lending server with `--tp > 1`: rank 0 plans each loop's
lending and every rank takes the same page ids out of its own pool (`_lend_tp`); the memory it
announces names every rank's pool (`MemoryDescriptor.ranks`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from ..config import SwiftConfig
from ..control import (
    BlocksReturned,
    ControlAgent,
    ControlConfig,
    LeaseGranted,
    LeaseLost,
    PeerChanged,
    ReclaimRequested,
    RequestFailed,
)
from ..dataplane import pool_geometry
from ..dataplane.borrowing import Borrowing
from ..dataplane.pool_lease import lending_page, pool_device
from .debug_seam import OBSERVERS
from .lending import NoLender, PoolLender, own_demand_tokens
from .reclaim_loss import ReclaimLoss
from .shared_kv_pool import shared_region_of

logger = logging.getLogger(__name__)


# the longest a donor's scheduler waits for lent pages its own requests need
OWN_PAGES_WAIT_S = 0.05
# a scheduler loop handles control events at most this often (and at once when woken)
STEP_INTERVAL_S = 0.02
# With TP, a lease is offered to matches until this long before its read deadline: the view
# rank 0 shares at a pump must stay true until the loads it admits have started.
TP_VIEW_MARGIN_S = 1.0
# With TP, the events that wake rank 0's scheduler loop (`loop_wake.py`): a donor waits for the
# acknowledgement of a reclaim; a TP donor's own requests wait for the pages that came back.
WAKE_EVENTS = (ReclaimRequested, BlocksReturned)


def _nothing(*args: Any) -> None:
    pass


def control_config_for(config: SwiftConfig, agent_id: str) -> ControlConfig:
    return ControlConfig(agent_id=agent_id, rendezvous_dir=config.resolved_rendezvous_dir(),
                         secret_file=config.resolved_secret_file(),
                         heartbeat_interval_s=config.heartbeat_interval_s,
                         heartbeat_timeout_s=config.heartbeat_timeout_s,
                         lease_margin_s=min(0.25, config.heartbeat_timeout_s / 4))


class SwiftRuntime:
    """The live side of SwiftCache in one server; see the module docstring for the contract."""

    def __init__(self, config: SwiftConfig, *, model: str, kv_pool: Any, allocator: Any,
                 tree: Any, page_size: int, agent_id: str | None = None,
                 tp: Any = None, stats: dict | None = None,
                 on_rescued: Callable[[Any], None] = _nothing, staging: Any = None,
                 spill: Any = None) -> None:
        """`stats`: the dict its counters go into (the cache's, shared with its other
        collaborators; a new one when None). `on_rescued(nodes)`: the tree nodes a reclaim moved
        into the host tier (their host copies go on to L3). A borrower with a host tier passes
        `staging` (a reclaimed page's rows are read into memory of its own,
        `reclaim_staging.ReclaimStaging`) and, with L3 below, `spill` (what found no host room
        goes to storage: `StorageHits.spill`)."""
        self.config = config
        self.tp = tp  # tp_sync.TpGroup with --tp > 1, else None
        self.kv_pool = kv_pool
        self.allocator = allocator
        self.tree = tree
        self.model = model
        # the page it lends or keeps in donor pages, refused with the reason when it cannot (a
        # borrower keeps K/V rows: MHA pools; a donor lends whatever rows it can give back: MHA
        # or MLA; scales beside the rows, non-NHD layouts: neither)
        self.geometry = (pool_geometry(kv_pool, page_size)
                         if config.borrows or config.streams_from_donor
                         else lending_page(kv_pool, page_size))
        self.device = pool_device(kv_pool)
        name = os.path.basename(model.rstrip("/")) or "model"
        self.agent_id = agent_id or f"{name}-{os.getpid()}"
        if tp is not None:
            self._check_shards(tp)
        if tp is None or tp.leader:
            self.agent = ControlAgent(control_config_for(config, self.agent_id), model=model)
        else:  # rank 0's agent speaks for the server
            from .tp_sync import FollowerAgent

            self.agent = FollowerAgent(self.agent_id)
        self._acks: list = []  # TP: reclaims to acknowledge once every rank fenced them
        self.wake = None  # TP rank 0: loop_wake.LoopWake, written by the agent's I/O thread
        if tp is not None and tp.leader:
            from .loop_wake import LoopWake

            self.wake = LoopWake()
        self._view: dict = {}  # TP: (donor, lease id) -> readable, as rank 0 saw it
        self.stats = {} if stats is None else stats
        self.stats.update({"stored_tokens": 0, "loaded_tokens": 0, "refused_loads": 0,
                           "refused_stores": 0, "revoked_tokens": 0, "leases": 0,
                           "reclaims": 0, "lost_leases": 0, "own_pages_wait_s": 0.0,
                           "reclaim_overflow_tokens": 0})
        self.reclaim_loss = ReclaimLoss()  # what reclaims dropped, counted when asked again
        self.on_rescued = on_rescued
        self.lender: PoolLender | NoLender = NoLender()  # a PoolLender once `start` lends
        self.borrowing: Any = NoBorrowing(self.agent)
        self._peers_present = False  # as of the last pump
        # the server's own cached tokens the lender may evict to lend (`start(evictable=)`)
        self._evictable: Callable[[], int] = lambda: self.tree.evictable_size()
        if config.borrows:
            self.borrowing = Borrowing(max_blocks=config.max_borrow_blocks,
                                       geometry=self.geometry, kv_pool=kv_pool, agent=self.agent,
                                       stats=self.stats, tp=tp, staging=staging, spill=spill)
        elif config.streams_from_donor:  # leases for the streamed pool's store, not the tree
            from ..layer_stream.store_leases import StoreLeases

            self.borrowing = StoreLeases.for_pool(kv_pool, agent=self.agent, stats=self.stats)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, make_room: Callable[[int], int] | None = None,
              evictable: Callable[[], int] | None = None) -> "SwiftRuntime":
        """Start the agent and, for a donor, lending; `make_room(tokens)` evicts that many tokens
        of the server's own cache (returns those evicted) to lend idle cached room (None: the
        lender counts only free pages, `PoolLender`), and `evictable()` is the part of that
        cache it may evict (default: the tree's evictable tokens)."""
        if evictable is not None:
            self._evictable = evictable
        if self.config.lends:
            shared = shared_region_of(self.kv_pool)
            if self.tp is not None and not self.tp.all_ok(shared is not None):
                shared = None  # every rank lends, or none
            if shared is None:
                logger.warning("SwiftCache: --swiftcache-lend-fraction is set but this server's "
                               "KV pool is not in shared memory (see the log line above); it "
                               "lends nothing")
            else:
                region, layout = shared
                descriptor = region.export()
                descriptor["layout"] = layout.to_dict()
                if self.tp is not None:  # every rank's pool, the same page ids in each
                    descriptor["ranks"] = self.tp.gather(descriptor)
                self.agent.set_memory(descriptor)
                self.lender = PoolLender(self.allocator, self.geometry.page_size,
                                         lend_fraction=self.config.lend_fraction,
                                         reclaim_watermark=self.config.reclaim_watermark,
                                         agent=self.agent,
                                         relend_cooldown_s=self.config.relend_cooldown_s,
                                         lend_cached_after_s=self.config.lend_cached_after_s,
                                         make_room=make_room)
        if self.holds_leases and self.tp is None:
            self.agent.on_reclaim(self._fence_reclaim)
        if self.wake is not None:
            self.agent.on_queued(self._wake_for)
        self.agent.start()
        logger.info("SwiftCache runtime %s started: lends up to %d tokens of its pool, borrows "
                    "up to %d blocks", self.agent_id,
                    self.lender.max_pages * self.geometry.page_size, self.borrowing.max_blocks)
        return self

    def stop(self) -> None:
        self.agent.stop()
        if self.wake is not None:
            self.wake.close()
        self.borrowing.close()

    # ---- waking the scheduler loop (TP rank 0) -----------------------------------------------
    def _wake_for(self, event: Any) -> None:
        """Agent's I/O thread, right after it queued `event`: wake the scheduler loop when the
        event waits for the pump."""
        if isinstance(event, WAKE_EVENTS):
            self.wake.wake()

    def watch_loop(self, scheduler: Any) -> None:
        """At the first scheduler step: let the agent's wakes reach `scheduler`'s idle sleeper
        (touchpoints.IDLE_POLLER). A no-op without a wake (TP 1, or a rank other than 0)."""
        if self.wake is None:
            return
        try:
            done = self.wake.watch(scheduler)
        except Exception as exc:  # the loop still pumps each time it runs
            done = f"registering failed ({exc!r}): an idle loop handles a reclaim when it wakes"
        logger.info("SwiftCache: the agent's wake of the scheduler loop: %s", done)

    def woken(self) -> bool:
        """Scheduler thread, each step: whether the agent woke the loop since the last step (the
        wake is drained, so an idle poll sleeps again); the pump is then due."""
        return self.wake is not None and self.wake.drain()

    # ---- the scheduler thread's step ------------------------------------------------------
    def _check_shards(self, tp: Any) -> None:
        """Every rank holds a shard of the same shape (the packing gives each one slice of every
        block); refused at start-up with every rank's shape otherwise."""
        shapes = tp.gather(repr(self.geometry))
        if len(set(shapes)) > 1:
            raise ValueError("the TP ranks' KV pools hold shards of different shapes ("
                             + "; ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
                             + "): SwiftCache stores one slice of each block per rank and "
                               "needs them alike")

    def pump(self, due: bool = True) -> None:
        """Handle what the agent queued; ask for leases; publish the capacity. With TP, called
        every scheduler loop on every rank: rank 0's `due` decides whether this loop pumps."""
        if self.tp is not None:
            self._pump_tp(due)
            return
        for event in self.agent.poll_events():
            self._handle(event)
        self._peers_present = self.agent.peer_count() > 0  # every pump: no full status
        self.borrowing.maybe_request(self._peers_present)
        self.agent.set_capacity(self.allocator.size, self.lent_tokens, self.borrowed_tokens(),
                                self.usable_tokens(), **self._tiers())

    def _pump_tp(self, due: bool) -> None:
        """One collective per loop (a size-only broadcast when rank 0 has nothing to say):
        rank 0's events and lease view, applied by every rank in rank 0's order; then the
        reclaims fenced by every rank are acknowledged by rank 0."""
        from .tp_sync import PumpStep

        msg = None
        if self.tp.leader and due:
            events = self.agent.poll_events()
            msg = PumpStep.of(events, *self._lease_view(events))
        msg = self.tp.share(msg, PumpStep)
        if msg is None:
            return
        events, view, deadlines = msg.unpack()
        self._view = view
        if not self.tp.leader:
            self.agent.set_view(deadlines)
        for event in events:
            self._handle(event)
        if self._acks:
            self.tp.barrier()  # every rank fenced and revoked the pages: nothing reads them
            for ev in self._acks:
                self.agent.ack_reclaim(ev)  # rank 0's agent; a no-op elsewhere
            self._acks = []
        if self.tp.leader:
            self._peers_present = self.agent.peer_count() > 0
            self.borrowing.maybe_request(self._peers_present)
            self.agent.set_capacity(self.allocator.size, self.lent_tokens,
                                    self.borrowed_tokens(), self.usable_tokens(), **self._tiers())

    def _lease_view(self, events: list) -> tuple[dict, dict]:
        """Rank 0: which held leases matches may offer until the next pump (donor there, read
        deadline more than TP_VIEW_MARGIN_S away; a lease granted in `events` from the next
        pump on), and each donor's read deadline (the other ranks' copies stop there)."""
        now = time.monotonic()
        donors = {donor for donor, _ in self.borrowing.leases}
        donors.update(ev.key.donor for ev in events if isinstance(ev, LeaseGranted))
        deadlines = {donor: self.agent.read_deadline(donor) for donor in donors}
        view = {key: held.engine.liveness() and now < deadlines[key[0]] - TP_VIEW_MARGIN_S
                for key, held in self.borrowing.leases.items()}
        return view, deadlines

    def readable(self, donor: str, lease_id: int, blocks: Any) -> bool:
        """Whether a donor residency on `blocks` of lease (donor, lease_id) may be offered and
        loaded now: lease held and readable, blocks not fenced by a reclaim. With TP, from the
        view rank 0 shared at the last pump, so every rank's tree decides alike."""
        if self.tp is not None:
            held = self.borrowing.leases.get((donor, lease_id))
            return (held is not None and self._view.get((donor, lease_id), False)
                    and not held.engine.fenced(blocks))
        engine = self.lease_engine(donor, lease_id)
        return engine is not None and engine.liveness() and not engine.fenced(blocks)

    def _tiers(self) -> dict:
        """The tree's lower tiers for `ctl status`: cached tokens in each, hits admitted."""
        from .metrics import tier_tokens

        return {**tier_tokens(self.tree),
                "donor_hit_tokens": self.stats.get("donor_hit_tokens", 0),
                "host_hit_tokens": self.stats.get("host_hit_tokens", 0)}

    def lend(self, scheduler: Any = None) -> None:
        """A donor's step, every scheduler loop (cheap: O(own requests)): demand lent pages back
        when its own room less its own requests' demand (`lending.own_demand_tokens`, read from
        `scheduler`'s queues) is short, else lend idle pages. Called after SGLang took in new
        requests and before it admits any, so a burst's demand leaves in the loop it arrived.

        When its own requests need pages that are out (a burst beyond its reserve), it waits for
        them at most `OWN_PAGES_WAIT_S`, handling the agent's events as `pump` does: the
        borrower acknowledges from its agent thread in about a millisecond, so the pages are
        usually back before SGLang admits the burst, which then runs as one batch instead of
        waiting a whole forward of the part that fitted. The wait ends at the bound whatever the
        borrower does (a dead one is declared so by the agent, later)."""
        if not self.lender.lends:  # nothing to plan (with TP: no collective either)
            return
        if self.tp is not None:
            self._lend_tp(scheduler)
            return
        needs_lent = self.lender.step(self._evictable(), self._peers_present,
                                      own_demand_tokens(scheduler))
        if needs_lent:
            self._await_own_pages(OWN_PAGES_WAIT_S)

    def _lend_tp(self, scheduler: Any) -> None:
        """A TP donor's step: rank 0 plans, every rank applies the plan at this step and takes
        the same page ids out of its own pool (checked); no wait for own pages (the events
        that return them are applied by every rank at a pump, `_pump_tp`)."""
        from .tp_sync import LendStep

        self.lender.keep_lent_out()  # each rank its own allocator, alike
        step = None
        if self.tp.leader:
            demand, lend = self.lender.plan(self._evictable(), self._peers_present,
                                            own_demand_tokens(scheduler))
            step = LendStep(demand, lend) if demand or lend else None
        step = self.tp.share(step, LendStep)
        if step is not None:
            self.lender.apply((step.demand, step.lend), self._same_pages)

    def _same_pages(self, pages: list[int]) -> bool:
        rows = self.tp.gather(pages, list[int])
        return all(row == rows[0] for row in rows)

    def _await_own_pages(self, timeout_s: float) -> None:
        start = time.monotonic()
        deadline = start + timeout_s
        while self.lender.demanded:
            left = deadline - time.monotonic()
            event = self.agent.next_event(timeout=left) if left > 0 else None
            if event is None:
                break
            self._handle(event)
        self.stats["own_pages_wait_s"] += time.monotonic() - start

    def _handle(self, event: Any) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(self, event)

    def attach_tree(self, tree: Any) -> None:
        """The cache was reset (a new, empty tree): register the leases still held in it."""
        self.tree = tree
        self.borrowing.attach_tree(tree)

    # ---- capacity, as SGLang's accounting and the operator see it -------------------------
    @property
    def holds_leases(self) -> bool:
        """Whether this server borrows (for its tree's donor tier or a layer stream's store)."""
        return not isinstance(self.borrowing, NoBorrowing)

    @property
    def lent_tokens(self) -> int:
        return self.lender.lent_tokens

    @property
    def reclaim_latencies(self) -> list[float]:
        """A donor's reclaim latencies so far (`PoolLender.reclaim_latencies`; the list grows)."""
        return self.lender.reclaim_latencies

    def borrowed_tokens(self) -> int:
        return self.borrowing.held_tokens()

    def usable_tokens(self) -> int:
        """This server's own usable KV capacity now: its pool minus what it lent."""
        return self.allocator.size - self.lent_tokens

    def cache_capacity_tokens(self) -> int:
        """Tokens the cache can hold now in every tier: the usable device pool, the host tier
        and the donor pages still lent to it. After a reclaim, what the tree held beyond this
        had to leave those tiers (to L3, else dropped) whatever the placement."""
        tiers = self.tree.tiers.values() if self.tree is not None else ()
        return self.usable_tokens() + sum(t.capacity_tokens() for t in tiers)

    # ---- events -----------------------------------------------------------------------------
    def _on_granted(self, ev: LeaseGranted) -> None:
        self.borrowing.on_granted(ev, self.tree)

    def _on_failed(self, ev: RequestFailed) -> None:
        self.borrowing.on_failed(ev.donor, ev.reason)

    def _fence_reclaim(self, ev: ReclaimRequested) -> None:
        """Agent's I/O thread, as the reclaim arrives: stop every copy touching the pages and
        acknowledge, without waiting for the scheduler loop. The tree still lists the blocks
        until `_on_reclaim`, but no copy can touch them any more."""
        t0 = time.perf_counter()
        probe = OBSERVERS.reclaim_fence  # the debug seam: where the thread's time went
        finish = probe() if probe is not None else None
        if self.borrowing.fence(ev):
            self.agent.ack_reclaim(ev)
            wall_ms = (time.perf_counter() - t0) * 1e3
            where = finish() if finish is not None else ""
            steps = getattr(self.borrowing, "last_fence", None)
            detail = ("" if steps is None else
                      f"{steps.blocks} blocks found in {steps.blocks_ms:.2f} ms, "
                      + (f"read for the host tier in {steps.staged_ms:.2f} ms, "
                         if steps.staged_ms else "")
                      + f"their copies fenced in {steps.copies_ms:.2f} ms "
                        f"({steps.aborted} aborted)")
            # logged once the ack is sent (a log write must not delay the donor)
            self.agent.defer(logger.info, "SwiftCache: acknowledged %s's reclaim of %d pages of "
                             "lease %d from the agent thread after %.2f ms of fencing (%s)",
                             ev.key.donor, len(ev.blocks), ev.key.lease_id, wall_ms,
                             "; ".join(filter(None, (detail, where))))

    def _on_reclaim(self, ev: ReclaimRequested) -> None:
        if self.holds_leases:  # (a reclaim comes only for a lease held)
            held = self.tree.held_tokens()
            result = self.borrowing.on_reclaim(ev, self.tree)
            self.stats["reclaim_overflow_tokens"] += max(0, held - self.cache_capacity_tokens())
            self.forget(result)
            if result is not None:
                self.reclaim_loss.add(result.lost_paths)
                if result.moved_nodes:
                    self.on_rescued(result.moved_nodes)  # their host copies go on to L3
        self.stats["reclaims"] += 1
        logger.info("SwiftCache: %s reclaimed %d pages of lease %d", ev.key.donor,
                    len(ev.blocks), ev.key.lease_id)
        if self.tp is not None:  # once every rank fenced them (_pump_tp)
            self._acks.append(ev)
            return
        # a no-op when _fence_reclaim acknowledged; else only now that nothing uses the pages
        self.agent.ack_reclaim(ev)

    def _on_lost(self, ev: LeaseLost) -> None:
        result = self.borrowing.on_lost(ev, self.tree)
        if result is None:
            return
        self.forget(result)
        self.stats["lost_leases"] += 1
        logger.warning("SwiftCache: lease %s lost (%s); its prefixes will be recomputed",
                       ev.key, ev.reason)

    def _on_returned(self, ev: BlocksReturned) -> None:
        self.lender.on_returned(list(ev.blocks))

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
        if result is not None:
            self.stats["revoked_tokens"] += result.num_tokens_lost

    # ---- copies the tree asks for (see Borrowing) -----------------------------------------
    def lease_engine(self, donor: str, lease_id: int) -> Any:
        return self.borrowing.lease_engine(donor, lease_id)

    def track(self, key: tuple[str, int], handle: Any, blocks: set[int]) -> None:
        """A copy started on lease `key` (`integration/copies.py`): a lost lease aborts it. (A
        reclaim of `blocks` finds it through the lease engine's fence, on the agent's thread.)"""
        self.borrowing.track(key, handle, blocks)

    def untrack(self, key: tuple[str, int], handle: Any) -> None:
        self.borrowing.untrack(key, handle)


class NoBorrowing:
    """The leases of a server that borrows nothing: none held, none asked for; a lease granted
    all the same goes back to its donor at once."""

    max_blocks = 0

    def __init__(self, agent: Any):
        self.agent = agent
        self.leases: dict = {}

    def maybe_request(self, peers_present: bool) -> None:
        pass

    def held_tokens(self) -> int:
        return 0

    def lease_engine(self, donor: str, lease_id: int) -> None:
        return None

    def on_granted(self, ev: Any, tree: Any) -> None:
        self.agent.release(ev.key)

    def on_failed(self, donor: str, reason: str) -> None:
        pass

    def fence(self, ev: Any) -> bool:
        return False

    def on_reclaim(self, ev: Any, tree: Any) -> None:
        return None

    def on_lost(self, ev: Any, tree: Any) -> None:
        return None

    def attach_tree(self, tree: Any) -> None:
        pass

    def close(self) -> None:
        pass


class ControlStep:
    """A runtime's share of each scheduler loop, as a tree cache's `swift_step` runs it: the
    first loop with the scheduler lets the runtime watch it (`watch_loop`); control events are
    pumped when woken or STEP_INTERVAL_S after the last pump (with TP every loop, rank 0's
    `due` deciding for all ranks); the lender weighs the server's own demand every loop (a
    burst's demand leaves in the loop it arrived)."""

    def __init__(self) -> None:
        self._last_pump = 0.0
        self._watching = False

    def __call__(self, runtime: Any, scheduler: Any, now: float) -> None:
        if not self._watching and scheduler is not None:
            self._watching = True
            runtime.watch_loop(scheduler)
        # woken first (drained every step): TP rank 0's agent woke the loop for an event that
        # waits for the pump (a reclaim), so this step pumps whenever the last one was
        due = runtime.woken() or now - self._last_pump >= STEP_INTERVAL_S
        if due:
            self._last_pump = now
        if due or runtime.tp is not None:
            runtime.pump(due)
        runtime.lend(scheduler)


class NoRuntime:
    """The runtime of a server that neither lends nor borrows (no control channel): nothing to
    pump, lend, track or attach; its counters are the cache's own (`stats`)."""

    tp = None
    lent_tokens = 0

    def __init__(self, stats: dict):
        self.stats = stats
        self.reclaim_loss = ReclaimLoss()  # stays empty: no reclaim without a donor tier
        self.reclaim_latencies: list[float] = []
        self.agent = self  # no control agent: nothing of its to check


    def watch_loop(self, scheduler: Any) -> None:
        pass

    def woken(self) -> bool:
        return False

    def pump(self, due: bool = True) -> None:
        pass

    def lend(self, scheduler: Any = None) -> None:
        pass

    def attach_tree(self, tree: Any) -> None:
        pass

    def check_integrity(self) -> None:
        pass
