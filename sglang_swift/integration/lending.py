"""The donor side: lend the idle part of this server's own SGLang KV pool, take it back on demand.

Capacity moves between the donor's SGLang allocator and its control agent's ledger in whole
pages (a donor block is one page of its pool: `block id == pool page id`):
- **lend**: pages allocated from the donor's own allocator (so its scheduler cannot hand them
  out and its admission sees the smaller pool at once) are offered to the agent's ledger;
- **reclaim**: when the donor's own free room falls below its reserve, the lender demands pages
  back; the agent returns them (`BlocksReturned`) only once no borrower reads them any more
  (after the borrower's acknowledgement, or after the borrower was declared dead), and only
  then are they freed into the allocator.
Each move is one allocator call and one agent command, whatever the number of layers.

SGLang's memory accounting stays exact: lent pages are neither free nor cached, so the tree cache
reports them in `protected_size()` (`lent_tokens`), which keeps the scheduler's idle invariant
`available + evictable + protected == total` and shows lent memory as in use in its logs.

Policy, in tokens of the donor's pool of size S:
- `reserve = (1 - reclaim_watermark) x S` stays free for the donor's own traffic at all times:
  lending never takes the allocator's free room, less what the donor's own queued requests will
  need, below `reserve` plus a headroom of 1/16 of the pool (so a little own traffic does not
  reclaim everything), and when free room plus the tree's evictable part, less that own demand,
  falls below it (the donor's own load is rising), every lent page is demanded back at once:
  the donor gets its whole pool for the burst (the reserve serves it meanwhile), rather than
  chasing a growing shortfall page by page;
- the own demand (`own_demand_tokens`) is read from the scheduler's queues every scheduler loop,
  after SGLang took in new requests and before it admits any: a burst's demand goes out in the
  loop its requests arrive in, not after its first requests were admitted into the reserve;
- at most `lend_fraction x S` is lent;
- after a reclaim, nothing is lent again for `relend_cooldown_s` (no oscillation while the
  donor's own burst lasts);
- once the donor has had no requests of its own for `lend_cached_after_s` (0: never), its own
  cached prefixes count as idle room too: lending evicts them, least recently used first,
  through the server's tree (`make_room`), so a donor whose burst filled its pool with
  prefixes nobody asks for lends again, still keeping the reserve and headroom free and at
  most `lend_fraction x S` out. Without this, a burst's cached prefixes would keep the donor
  from lending until its own traffic happened to evict them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from ..config import SwiftConfig

logger = logging.getLogger(__name__)

RELEND_COOLDOWN_S = SwiftConfig.relend_cooldown_s  # --swiftcache-relend-cooldown-s's default
MIN_OFFER_PAGES = 1


def own_demand_tokens(scheduler: Any) -> int:
    """KV tokens the server's own requests will still need, counted as SGLang's admission
    (`PrefillAdder`) counts them: a waiting request its whole sequence so far plus its output
    budget, a running one its output budget left times the scheduler's new-token ratio (1 for
    `ignore_eos`); budgets clipped as SGLang clips them. A waiting request's cached prefix is
    counted too, and rightly: it sits in the tree's evictable part, which the lender counts as
    room, and admission locks it. O(requests); 0 without a scheduler (tests, other callers).
    A re-implementation of SGLang's arithmetic, checked at start-up (`touchpoints.OWN_DEMAND`)."""
    if scheduler is None:
        return 0
    total = 0
    for req in scheduler.waiting_queue:
        total += len(req.origin_input_ids) + len(req.output_ids) + output_budget(req)
    running = getattr(scheduler, "running_batch", None)
    if running is not None and running.reqs:
        ratio = scheduler.new_token_ratio_tracker.current
        for req in running.reqs:
            total += running_demand(req, ratio)
    return int(total)


def output_budget(req: Any) -> int:
    """The output tokens a request may still make, clipped as SGLang's admission clips them."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    left = (req.sampling_params.max_new_tokens or 0) - len(req.output_ids)
    return min(max(left, 0), CLIP_MAX_NEW_TOKENS)


def running_demand(req: Any, new_token_ratio: float) -> float:
    """A running request's KV demand as `PrefillAdder` reserves it: its output budget times
    the new-token ratio (1 for `ignore_eos`)."""
    return output_budget(req) * (1.0 if req.sampling_params.ignore_eos else new_token_ratio)


class NoLender:
    """A server that lends nothing (not a donor, or its pool is not in shareable memory)."""

    lends = False
    lent_tokens = 0
    max_pages = 0

    def __init__(self) -> None:
        self.reclaim_latencies: list[float] = []

    def on_returned(self, blocks: list[int]) -> None:
        pass


class PoolLender:
    """Pages of one server's KV pool lent through its control agent. Runs on the scheduler
    thread (it calls the allocator); `agent` is the server's ControlAgent."""

    lends = True

    def __init__(self, allocator: Any, page_size: int, *, lend_fraction: float,
                 reclaim_watermark: float, agent: Any,
                 clock: Callable[[], float] = time.monotonic,
                 relend_cooldown_s: float = RELEND_COOLDOWN_S,
                 lend_cached_after_s: float = 0.0,
                 make_room: Callable[[int], int] | None = None) -> None:
        if allocator.size % page_size:
            raise ValueError(f"pool size {allocator.size} is not a whole number of "
                             f"{page_size}-token pages")
        self.allocator = allocator
        self.page_size = page_size
        self.agent = agent
        self.max_pages = int(allocator.size * lend_fraction) // page_size
        self.reserve_tokens = int(allocator.size * (1.0 - reclaim_watermark))
        # lending stops this far above the reserve, so a little own traffic (SGLang's 1-token
        # /health probe at start-up) does not trigger a reclaim of everything
        self.headroom_tokens = max(page_size, allocator.size // 16)
        self.clock = clock
        self.relend_cooldown_s = relend_cooldown_s
        self.lend_cached_after_s = lend_cached_after_s
        self.make_room = make_room  # evicts this many tokens of the donor's own cache
        self._last_own = float("-inf")  # when the donor last had requests of its own
        self.lent: set[int] = set()  # pool pages out of the allocator (offered or granted)
        self.demanded = 0  # pages asked back, not returned yet
        self.off = False  # lends no more (the TP ranks' allocators diverged)
        self._quiet_until = 0.0
        self.stats = {"lent_pages_total": 0, "returned_pages_total": 0, "demands": 0,
                      "cache_evicted_to_lend_tokens": 0}
        self.reclaim_started: float | None = None
        self.reclaim_latencies: list[float] = []  # seconds from a demand to its last page back

    # ---- what SGLang's accounting needs --------------------------------------------------
    @property
    def lent_tokens(self) -> int:
        return len(self.lent) * self.page_size

    def usable_tokens(self) -> int:
        """The donor's own usable capacity now: its pool minus what is lent."""
        return self.allocator.size - self.lent_tokens

    # ---- one scheduler-loop step ---------------------------------------------------------
    def step(self, evictable_tokens: int, borrowers_present: bool,
             own_demand_tokens: int = 0) -> bool:
        """Demand pages back when the donor's own room, less `own_demand_tokens` (what its
        queued and running requests will still need: `own_demand_tokens(scheduler)`), is short
        of the reserve; else lend idle pages beyond that demand. Returns whether its own
        requests need lent pages now (their demand exceeds its free and evictable room while
        pages are out): the caller may then wait briefly for them (`SwiftRuntime.lend`)."""
        self.keep_lent_out()
        self.apply(self.plan(evictable_tokens, borrowers_present, own_demand_tokens))
        return self.needs_lent(evictable_tokens, own_demand_tokens)

    def plan(self, evictable_tokens: int, borrowers_present: bool,
             own_demand_tokens: int = 0) -> tuple[int, int]:
        """(pages to demand back, pages to lend) now, deciding nothing else: with TP, rank 0
        plans and every rank applies the same plan (`apply`) at the same scheduler step."""
        free = self.allocator.available_size()
        now = self.clock()
        if own_demand_tokens > 0:
            self._last_own = now
        # pages already demanded will come back: count them as room
        short = self.reserve_tokens - (free + evictable_tokens - own_demand_tokens
                                       + self.demanded * self.page_size)
        outstanding = len(self.lent) - self.demanded
        if short > 0 and outstanding > 0:
            return outstanding, 0
        if self.demanded or self.off or not borrowers_present or now < self._quiet_until:
            return 0, 0
        room = (free + self._idle_cache(evictable_tokens, now) - own_demand_tokens
                - self.reserve_tokens - self.headroom_tokens) // self.page_size
        want = min(room, self.max_pages - len(self.lent))
        return 0, (want if want >= MIN_OFFER_PAGES else 0)

    def apply(self, plan: tuple[int, int],
              same_pages: Callable[[list[int]], bool] | None = None) -> None:
        """Carry out `plan` (`plan()`'s pair). `same_pages(pages)`, with TP: whether every
        rank took the same page ids out of its allocator (a collective); when not, every rank
        gives its pages back and lends nothing."""
        demand, lend = plan
        if demand > 0:
            self.agent.demand(demand)
            self.demanded += demand
            self.stats["demands"] += 1
            if self.reclaim_started is None:
                self.reclaim_started = self.clock()
            self._quiet_until = self.clock() + self.relend_cooldown_s
            logger.info("SwiftCache: own traffic needs room: reclaiming %d lent pages", demand)
        if lend > 0:
            self._lend(lend, same_pages)

    def _idle_cache(self, evictable_tokens: int, now: float) -> int:
        """The donor's own cached tokens that count as lendable room now: all its evictable ones
        once it has been without requests of its own for `lend_cached_after_s`, else none."""
        if self.make_room is None or self.lend_cached_after_s <= 0:
            return 0
        return evictable_tokens if now - self._last_own >= self.lend_cached_after_s else 0

    def needs_lent(self, evictable_tokens: int, own_demand_tokens: int) -> bool:
        """Whether own requests need pages that are out (demanded, not back yet)."""
        return bool(self.demanded) and \
            own_demand_tokens > self.allocator.available_size() + evictable_tokens

    def keep_lent_out(self) -> None:
        """SGLang's /flush_cache (`Scheduler.flush_cache`, on an idle server) resets the tree and
        clears the allocator, lent pages included, in the loop's request intake. `step` runs
        later in the same loop (on every TP rank, each for its own allocator), before anything
        is admitted and before SGLang's idle memory check: this takes the lent pages out again
        through the allocator's own alloc/free, so none is handed to this server's requests
        while a borrower holds it. O(1) when nothing was cleared (free room plus lent never
        exceeds the pool otherwise); O(pool) once after."""
        if self.allocator.available_size() + self.lent_tokens <= self.allocator.size:
            return
        slots = self.allocator.alloc(self.allocator.available_size())
        if slots is None:  # cannot happen (alloc of what it reports available); say so if it does
            logger.error("SwiftCache: the allocator was cleared while %d pages are lent and they "
                         "could not be taken out again", len(self.lent))
            return
        lent = torch.tensor(sorted(self.lent), dtype=slots.dtype, device=slots.device)
        self.allocator.free(slots[~torch.isin(slots // self.page_size, lent)])
        logger.warning("SwiftCache: the KV allocator was cleared (a cache flush) while %d pages "
                       "were lent; they were taken out of it again", len(self.lent))

    def _lend(self, n_pages: int, same_pages: Callable[[list[int]], bool] | None) -> None:
        # the plan counted idle cached prefixes as room: evict enough of them that the reserve
        # and headroom stay free after lending (0 when the room was free pages)
        keep = self.reserve_tokens + self.headroom_tokens
        short = n_pages * self.page_size + keep - self.allocator.available_size()
        if short > 0 and self.make_room is not None:
            self.stats["cache_evicted_to_lend_tokens"] += self.make_room(short)
            n_pages = min(n_pages, (self.allocator.available_size() - keep) // self.page_size)
            if n_pages < MIN_OFFER_PAGES:
                return
        slots = self.allocator.alloc(n_pages * self.page_size)
        pages = [] if slots is None else sorted(set((slots // self.page_size).tolist()))
        if slots is not None and len(pages) * self.page_size != len(slots):
            # page_size 1 allocators hand out arbitrary slots; a page is a slot there
            raise RuntimeError("allocator returned slots that are not whole pages")
        if same_pages is not None and not same_pages(pages):
            # the ranks' allocators diverged (they see the same requests, so they should not):
            # lend nothing rather than pages a rank still uses
            if slots is not None:
                self.allocator.free(slots)
            self.off = True
            logger.error("SwiftCache: the TP ranks' allocators handed out different pages to "
                         "lend; this server lends nothing from now on")
            return
        if slots is None:
            return
        self.lent.update(pages)
        self.stats["lent_pages_total"] += len(pages)
        self.agent.offer(pages)

    def on_returned(self, blocks: list[int]) -> None:
        """The agent gave pages back (no borrower reads them any more): free them into the
        allocator, so the donor's usable capacity grows back."""
        pages = [b for b in blocks if b in self.lent]
        unknown = len(blocks) - len(pages)
        if unknown:
            logger.error("SwiftCache: agent returned %d pages this server never lent", unknown)
        if not pages:
            return
        self.lent.difference_update(pages)
        self.demanded = max(0, self.demanded - len(pages))
        self.allocator.free_page_ids(torch.tensor(pages, dtype=torch.int64,
                                                  device=self.allocator.device))
        self.stats["returned_pages_total"] += len(pages)
        if self.demanded == 0 and self.reclaim_started is not None:
            self.reclaim_latencies.append(self.clock() - self.reclaim_started)
            self.reclaim_started = None

    def check_integrity(self) -> None:
        if not 0 <= self.demanded <= len(self.lent):
            raise AssertionError(f"demanded {self.demanded} of {len(self.lent)} lent pages")
        if len(self.lent) > self.max_pages:
            raise AssertionError(f"{len(self.lent)} pages lent, more than {self.max_pages}")
