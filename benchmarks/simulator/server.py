"""One model server on one GPU: SGLang-like continuous batching over a real radix_ext tree.

Each step is either a prefill (extend) batch, FCFS, up to `chunk` new tokens with chunked prefill,
or one decode step for every running request; prefill goes first when a request can be admitted
(SGLang's default). Admission is radix_ext's (`radix_ext.admission.admit`): match the prompt,
lock the device prefix, allocate pages (evicting through the tree, whose demotion copies must
finish before the step computes), re-match if that touched the pages to load, and start the
load-back of lower-tier pages. How a load overlaps compute depends on `load_mode`:
  "layerwise": the batch waits for loads layer by layer (HiCache, SwiftCache): the step ends at
               max(compute end, last load end + one layer of compute);
  "before":    the request loads first and joins a batch when done (vLLM offloading connector);
  "none":      no lower tiers: misses are recomputed (SGLang radix cache only).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Callable

from radix_ext import DevicePool, admit, evict

from . import sglang_order
from .cache_adapter import TreeCache
from .roofline import Roofline


@dataclass(eq=False)
class SimRequest:
    rid: int
    session: str
    turn: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    key_prompt: array  # page ids of the prompt's cacheable full pages (last token excluded)
    key_full: array  # page ids of the full pages of prompt + output (what is cached at the end)
    hit_tokens: dict = field(default_factory=dict)  # tier -> tokens served from it
    extend: int = 0
    done_extend: int = 0
    first_token: float | None = None
    finish: float | None = None
    generated: int = 0
    last_token_t: float = 0.0
    itls: list = field(default_factory=list)
    load_time: float | None = None
    admitted: bool = False
    lock_node: object = None
    anchor: object = None
    ticket: object = None
    own: array = field(default_factory=lambda: array("q"))
    prefix_pages: int = 0
    loads_left: int = 0
    load_start: float = 0.0
    on_done: Callable | None = None
    barrier: "Barrier | None" = None
    rejected: bool = False

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


class _StepPool(DevicePool):
    """The server's device pages as radix_ext admission sees them during one step: a demotion
    copy starts on the node's links (the step's compute waits for it; its bookkeeping settles at
    once), and a donor under pressure takes lent pages back."""

    def __init__(self, server: "ModelServer", pending: list) -> None:
        self.server, self.pending = server, pending

    def available(self) -> int:
        return self.server.cache.free_pages()

    def alloc(self, n: int):
        return self.server.cache.alloc(n)

    def free(self, indices) -> None:
        self.server.cache.free(indices)

    def run_copies(self, copies):
        self.server._run_copies(copies, self.pending)
        return [True] * len(copies)

    def reclaim(self, num_tokens: int) -> None:
        self.server._reclaim_if_pressed(num_tokens)


class Barrier:
    """Runs `fn` once `n` outstanding completions have arrived and `arm()` was called."""

    def __init__(self) -> None:
        self.n, self.armed, self.fn = 0, False, None

    def dec(self) -> None:
        self.n -= 1
        if self.n == 0 and self.armed:
            self.armed = False
            self.fn()

    def arm(self, fn) -> None:
        self.fn, self.armed = fn, True
        if self.n == 0:
            self.armed = False
            fn()


class ModelServer:
    def __init__(self, name: str, gpu: "object", roofline: Roofline, cache: TreeCache, *,
                 page_tokens: int, chunk: int, max_running: int, load_mode: str, node: "object",
                 demote_headroom: int = 0, checkpoint_prompt: bool = False,
                 alloc_per_step: bool = False):
        """`demote_headroom`: pages the server keeps free by demoting LRU prefixes ahead of need,
        beside its steps (the live borrower's old `demote_ahead`, 1/8 of its pool); 0: none.
        `checkpoint_prompt`: publish a request's prompt in the tree when its prefill ends, as
        SGLang 0.5.23 does (`checkpoint_kv_cache`), so nodes split at prompt boundaries and evict
        as SGLang's do; the GPU sweeps of docs/simulation.md ran without it.
        `alloc_per_step`: allocate as SGLang does (`sglang_order.py`): the prompt at
        admission, each output token in its decode step, each evicting only its shortfall;
        False: prompt and output at admission (the GPU sweeps)."""
        if load_mode not in ("layerwise", "before", "none"):
            raise ValueError(f"unknown load_mode {load_mode!r}")
        self.name, self.gpu, self.rl, self.cache = name, gpu, roofline, cache
        self.P, self.chunk = page_tokens, chunk
        self.max_running, self.load_mode = max_running, load_mode
        self.node = node  # gives loop, transfer paths and HBM DMA rates
        self.page_bytes = page_tokens * roofline.model.kv_bytes_per_token
        self.waiting: list[SimRequest] = []
        self.loading: set = set()
        self.running: list[SimRequest] = []
        self.chunked: SimRequest | None = None
        self.busy = False
        self.done: list[SimRequest] = []
        self.busy_time = 0.0
        self.lent_pages = array("q")  # pages taken out of the pool and lent (donor side)
        self.on_pressure: Callable[[int], None] | None = None  # donor: ask for lent pages back
        self.watermark = 1.0
        self.load_failures = 0
        self.rejected: list[SimRequest] = []
        self.demote_headroom = demote_headroom
        self.checkpoint_prompt = checkpoint_prompt
        self.alloc_per_step = alloc_per_step
        self._barrier = Barrier()

    # -- entry points ------------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self._kick()

    def _kick(self) -> None:
        if not self.busy:
            self.busy = True
            self.node.loop.after(0.0, self._step)

    # -- admission ---------------------------------------------------------------------------------
    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.P)

    def _admit(self, r: SimRequest, pending: list) -> bool:
        """Admit `r` through radix_ext's admission (match, lock, allocate evicting, re-match,
        start loads). False (nothing held) when out of memory."""
        c = self.cache
        total = self._pages(r.prompt_tokens + r.output_tokens)
        if total > c.device_pages - len(self.lent_pages):
            r.rejected = True  # longer than this server's whole KV pool: SGLang rejects it
            return True
        if self.alloc_per_step:
            a = self._admit_as_sglang(r, pending)
        else:
            a = admit(c.tree, _StepPool(self, pending), r.key_prompt, total=total,
                      load=self.load_mode != "none")
        if a is None or not a.ok:
            return False
        m, ticket = a.match, a.load
        r.anchor = r.lock_node = a.anchor
        r.hit_tokens = {"device": m.device_len * self.P}
        r.prefix_pages = a.prefix_len
        r.own = a.slots
        if ticket is not None:
            r.ticket = ticket
            for cp in ticket.copies:
                tier = cp.src_tier
                r.hit_tokens[tier] = r.hit_tokens.get(tier, 0) + len(cp.dst.indices) * self.P
            r.loads_left = len(ticket.copies)
            r.load_start = self.node.loop.now
            for cp in ticket.copies:
                self.node.copy(self, cp, lambda t, r=r: self._load_done(r))
            if self.load_mode == "layerwise":
                r.barrier = self._barrier
                self._barrier.n += 1
        r.extend = r.prompt_tokens - r.prefix_pages * self.P
        r.admitted = True
        return True

    def _admit_as_sglang(self, r: SimRequest, pending: list):
        return sglang_order.admit(self.cache, _StepPool(self, pending), r.key_prompt,
                                  self._pages(r.prompt_tokens), self.load_mode != "none")

    def _alloc_decode_slots(self, pending: list) -> None:
        if self.alloc_per_step:
            sglang_order.decode_slots(self.cache, _StepPool(self, pending), self.running, self.name)

    def evict(self, pages: int) -> int:
        """Evict `pages` now (demotion copies start on the links; the next step waits for
        them); returns the pages evicted."""
        return evict(self.cache.tree, _StepPool(self, []), pages)

    def _run_copies(self, copies, pending: list) -> None:
        b = self._barrier
        for cp in copies:
            b.n += 1
            pending.append(self.node.copy(self, cp, lambda t, b=b: b.dec()))

    def _load_done(self, r: SimRequest) -> None:
        r.loads_left -= 1
        if r.loads_left:
            return
        out = self.cache.complete_load(r.ticket)
        r.load_time = self.node.loop.now - r.load_start
        if out.ok:
            self.cache.unlock(r.anchor)
            r.lock_node = out.last_node
        else:  # a donor revoked blocks under the load: recompute those pages instead
            lost = len(r.ticket.device_indices)
            for tier in ("donor", "host"):
                r.hit_tokens.pop(tier, None)
            r.prefix_pages -= lost
            r.extend += lost * self.P
            again = self.cache.alloc(lost)  # the failed ticket just returned exactly these
            again.extend(r.own)
            r.own = again
            self.load_failures += 1
        r.ticket = None
        if r.barrier is not None:
            r.barrier.dec()
        if r in self.loading:  # "before" mode: now ready to be scheduled
            self.loading.discard(r)
            self.waiting.insert(0, r)
            self._kick()

    def _reclaim_if_pressed(self, need: int) -> None:
        """Donor side: own non-evictable use above the watermark takes lent pages back."""
        if not self.lent_pages or self.on_pressure is None:
            return
        c = self.cache
        own_cap = c.device_pages - len(self.lent_pages)
        in_use = own_cap - c.free_pages() - c.evictable()
        short = in_use + need - self.watermark * own_cap
        if short > 0 or c.free_pages() + c.evictable() < need:
            self.on_pressure(int(max(short, need - c.free_pages() - c.evictable())) + 1)

    # -- the step loop ---------------------------------------------------------------------------
    def _step(self) -> None:
        free = self.cache.free_pages()
        if self.demote_headroom and free < self.demote_headroom:
            # its copies count on the old barrier: no step waits
            self.evict(self.demote_headroom - free)
        self._barrier = Barrier()
        batch, parts, pending = self._form_prefill()
        now = self.node.loop.now
        hbm = self.node.dma_rate(self.gpu)
        if batch:
            items = [(n, r.prompt_tokens - r.extend + r.done_extend) for r, n in zip(batch, parts)]
            t_c = self.rl.step_time(items, hbm)
            self._close_when_ready(now, t_c, batch, parts, pending)
        elif self.running:
            self._alloc_decode_slots(pending)
            items = [(1, r.prompt_tokens + r.generated) for r in self.running]
            t_c = self.rl.decode_step_time(items, hbm)
            if pending:  # the step's evictions stored victims: it computes once they are copied
                self._barrier.arm(lambda: self._decode_when_copied(now, t_c, pending))
            else:
                self.busy_time += t_c
                self.node.loop.after(t_c, self._decode_done)
        else:
            self.busy = False

    def _form_prefill(self):
        batch, parts, pending = [], [], []
        budget = self.chunk
        cands = ([self.chunked] if self.chunked else []) + list(self.waiting)
        for r in cands:
            if budget <= 0 or len(self.running) + len(batch) >= self.max_running:
                break
            if not r.admitted:
                if not self._admit(r, pending):
                    break  # FCFS: the head waits for memory
                if r.rejected:
                    self.waiting.remove(r)
                    self.rejected.append(r)
                    continue
                if self.load_mode == "before" and r.ticket is not None:
                    self.waiting.remove(r)
                    self.loading.add(r)
                    continue
            n = max(0, min(budget, r.extend - r.done_extend))
            batch.append(r)
            parts.append(n)
            budget -= max(n, 1)
            if r is not self.chunked:
                self.waiting.remove(r)
            if r.done_extend + n < r.extend:
                self.chunked = r
            elif r is self.chunked:
                self.chunked = None
        return batch, parts, pending

    def _close_when_ready(self, start, t_c, batch, parts, pending) -> None:
        """End the prefill at max(start + compute, pre-copies end + compute, loads end + 1
        layer)."""
        layer = t_c / self.rl.model.layers
        load_reqs = [r for r in batch if r.ticket is not None]

        def try_close():
            for r in load_reqs:
                r.barrier = None
            now = self.node.loop.now
            pre_end = max([t.end for t in pending], default=start)
            load_end = max([r.load_start + (r.load_time or 0.0) for r in load_reqs], default=start)
            end = max(start + t_c, pre_end + t_c, load_end + layer, now)
            self.busy_time += end - start
            self.node.loop.at(end, lambda: self._prefill_done(batch, parts))

        self._barrier.arm(try_close)

    def _decode_when_copied(self, start: float, t_c: float, pending: list) -> None:
        end = max(start + t_c, max(t.end for t in pending) + t_c, self.node.loop.now)
        self.busy_time += end - start
        self.node.loop.at(end, self._decode_done)

    def _prefill_done(self, batch, parts) -> None:
        now = self.node.loop.now
        for r, n in zip(batch, parts):
            r.done_extend += n
            if r.done_extend < r.extend and r is not self.chunked:
                self.waiting.insert(0, r)  # a failed load added pages to recompute
                continue
            if r.done_extend >= r.extend and r is not self.chunked:
                r.first_token = now
                r.last_token_t = now
                r.generated = 1
                if r.generated >= r.output_tokens:
                    self._finish(r)
                else:
                    if self.checkpoint_prompt:
                        self._checkpoint(r)
                    self.running.append(r)
        self._step()

    def _checkpoint(self, r: SimRequest) -> None:
        """Insert the prompt's full pages, take the tree's path as the request's prefix and
        move its lock there (SGLang's `checkpoint`); its own slots past the prompt stay its own."""
        c = self.cache
        n = r.prompt_tokens // self.P
        if n <= r.prefix_pages:
            return
        mine = n - r.prefix_pages
        idx = array("q", c.path_indices(r.lock_node))
        idx.extend(r.own[:mine])
        res = c.insert(r.key_full[:n], idx)
        c.free(r.own[:max(0, res.duplicate_len - r.prefix_pages)])
        c.lock(res.last_node)
        c.unlock(r.lock_node)
        r.lock_node = res.last_node
        r.own = r.own[mine:]
        r.prefix_pages = n

    def _decode_done(self) -> None:
        now = self.node.loop.now
        still = []
        for r in self.running:
            r.generated += 1
            r.itls.append(now - r.last_token_t)
            r.last_token_t = now
            if r.generated >= r.output_tokens:
                self._finish(r)
            else:
                still.append(r)
        self.running = still
        self._step()

    def _finish(self, r: SimRequest) -> None:
        c = self.cache
        r.finish = self.node.loop.now
        n_full = len(r.key_full)
        prefix = c.path_indices(r.lock_node)
        keep = n_full - r.prefix_pages
        idx = array("q", prefix)
        idx.extend(r.own[:keep])
        res = c.insert(r.key_full, idx)
        dup_own = max(0, res.duplicate_len - r.prefix_pages)
        c.free(r.own[:dup_own])
        c.free(r.own[keep:])
        c.unlock(r.lock_node)
        r.own = array("q")
        self.done.append(r)
        if r.on_done:
            r.on_done(r)
